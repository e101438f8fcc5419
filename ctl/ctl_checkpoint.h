// `ragshardctl checkpoint inspect DIR`: a checkpoint written by ragshard.checkpoint (Python),
// read without Python: its tensors and their sizes, the plan it was saved under, and its
// integrity (every piece's file present and long enough, and the CRC-32 of every chunk).
// The format is described in python/ragshard/checkpoint/_format.py and docs/checkpoint.md.
#pragma once

#include <ostream>
#include <string>

namespace ragshard {

// DIR is a checkpoint root (its `latest` checkpoint is inspected) or one checkpoint's
// directory. Returns 0 when the checkpoint is complete and intact, 1 when a file is missing,
// short or corrupted (each named with the tensor it holds), 2 when DIR is not a checkpoint.
int RunCheckpointInspect(const std::string& dir, bool json, std::ostream& out, std::ostream& err);

}  // namespace ragshard
