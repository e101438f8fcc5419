// The contract between the daemon and the training processes about a rank's state buffers in
// the daemon's pool (docs/recovery.md): their names and the step journal's layout, defined here
// once. The C++ side uses these constants; the Python side reads the same through the C ABI
// (rs_pool_contract, PoolContractJson), and tests/python/test_pool_contract.py fails where a
// source of either side spells a name of its own.
//
// Names, by family (a prefix, then what the family puts after it):
//   shard/<unit>                 a parameter shard (the daemon's own buffer, named so in the
//                                journal and in the redundancy's segments)
//   journal/meta                 the step journal's marks: kJournalMetaFields int64 (committed,
//                                begun, base, base before), which the daemon reads (its
//                                progress, OP_PROTECT and OP_REBUILD's steps)
//   journal/manifest, journal/held   what the undo copies cover, and what the rank held at its
//                                last commit (text the rank writes and reads)
//   journal/undo/<state>         a state buffer's undo copy
//   opt/<owner>/<key>/<unit>     an optimizer's state of a unit's pieces
//   (opt/ and journal/undo/ are in the rank's memory: InRankMemory)
//   shrink/taken, shrink/recut, shrink/in_place, shrink/steps/<opt prefix>   a shrink's marks
//   copy/<step>/directory, copy/<step>/directory.bytes, copy/<step>/<segment>   another node's
//                                whole copy, exposed to a salvage attachment
#pragma once

#include <cstdint>
#include <string>

namespace ragshard::pool {

// Family prefixes.
inline constexpr char kShard[] = "shard/";
inline constexpr char kJournal[] = "journal/";
inline constexpr char kOptimizer[] = "opt/";
inline constexpr char kShrink[] = "shrink/";
inline constexpr char kCopy[] = "copy/";

// Whole names.
inline constexpr char kJournalMeta[] = "journal/meta";
inline constexpr char kJournalManifest[] = "journal/manifest";
inline constexpr char kJournalHeld[] = "journal/held";
inline constexpr char kJournalUndo[] = "journal/undo/";  // + the state buffer's name
inline constexpr char kShrinkTaken[] = "shrink/taken";
inline constexpr char kShrinkRecut[] = "shrink/recut";
inline constexpr char kShrinkInPlace[] = "shrink/in_place";
inline constexpr char kShrinkSteps[] = "shrink/steps/";  // + an optimizer state's prefix
inline constexpr char kCopyDirectory[] = "directory";    // copy/<step>/directory
inline constexpr char kCopyDirectoryBytes[] = "directory.bytes";

// The step journal's marks (journal/meta): int64 fields. Committed and begun count the
// journal's transactions (optimizer steps and loads); the training step a rank's state is at is
// committed + base, a load setting the base (docs/recovery.md, "Checkpoints"); base before: the
// base at the start of the last transaction (a rollback puts it back).
inline constexpr int kJournalMetaFields = 4;
inline constexpr int kJournalCommitted = 0;
inline constexpr int kJournalBegun = 1;
inline constexpr int kJournalBase = 2;
inline constexpr int kJournalBaseBefore = 3;

// Whether state buffer `name` lives in its rank's memory, beside its parameter shards (a GPU's
// slab on the CUDA backend, which the rank maps as CUDA tensors): the optimizers' state
// ("opt/...") and the undo copies ("journal/undo/..."). Every other buffer (the journal's marks,
// manifest and held list, a shrink's marks, exposed copies) is host memory of the pool, which
// the daemon reads directly. On the host backends both are the pool.
bool InRankMemory(const std::string& name);

// "shard/<unit>".
std::string ShardName(int64_t unit);
// "copy/<step>/<rest>".
std::string CopyName(int64_t step, const std::string& rest);
// The contract as JSON, for the C ABI: {"prefixes": {...}, "names": {...}, "journal_meta":
// {"fields": N, "committed": i, "begun": j}}.
std::string PoolContractJson();

}  // namespace ragshard::pool
