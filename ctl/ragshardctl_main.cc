// ragshardctl: thin entry point; see ctl/ctl.h.
#include <iostream>

#include "ctl/ctl.h"

int main(int argc, char** argv) { return ragshard::RunCtl(argc, argv, std::cout, std::cerr); }
