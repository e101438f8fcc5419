// ragshardctl's renderings of the strategy search: JSON for scripts and tables for people.
//
// Thread-safe: the functions are pure.
#pragma once

#include <string>

#include "engine/strategy_model.h"
#include "engine/strategy_search.h"

namespace ragshard {

// JSON of an advice ({"recommendation": {...}, "candidates": [...], "rejected": [...]}) and of
// one evaluation.
std::string AdviceJson(const Advice& advice, const StrategyModel& model, int max_rejected);
std::string EvaluationJson(const Evaluation& e);

// Human-readable forms for ragshardctl.
std::string AdviceTable(const Advice& advice, const StrategyModel& model, int max_rejected);
std::string SimulationReport(const Evaluation& e, const StrategyModel& model, int width = 100);

}  // namespace ragshard
