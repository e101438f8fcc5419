// ragshardctl: thin entry point; see client/ctl.h.
#include <iostream>

#include "client/ctl.h"

int main(int argc, char** argv) { return ragshard::RunCtl(argc, argv, std::cout, std::cerr); }
