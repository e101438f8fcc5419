#include "server/planner/node_registry.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "infra/status_macros.h"

namespace ragshard::planner {

void NodeRegistry::Load(std::vector<v1::Node> nodes, int64_t now_ms) {
  absl::MutexLock lock(&mu_);
  for (v1::Node& node : nodes) {
    node.set_last_heartbeat_unix_ms(now_ms);
    nodes_[node.node_id()] = std::move(node);
  }
}

absl::StatusOr<std::string> NodeRegistry::Register(const v1::RegisterNodeRequest& req,
                                                   int64_t now_ms) {
  absl::MutexLock lock(&mu_);
  auto [it, fresh] = nodes_.try_emplace(req.node_id());
  v1::Node& node = it->second;
  std::string lost;
  if (!fresh && node.status() == v1::NODE_UP && node.incarnation() != 0 && req.incarnation() != 0 &&
      node.incarnation() != req.incarnation()) {
    lost =
        absl::StrCat("node '", req.node_id(), "' lost (another daemon registered with its id, ",
                     "from '", req.data_address(), "', while it was up; its daemon at '",
                     node.data_address(), "' went silent ", now_ms - node.last_heartbeat_unix_ms(),
                     " ms before, without closing its connections)");
    LOG(WARNING) << lost;
  }
  if (!fresh) {
    // The same daemon again (it was forgotten, or it restarted), or a replacement daemon for a
    // lost node: the new registration replaces the old one whole, its figures included.
    LOG(INFO) << "node " << req.node_id() << " registers again (was "
              << v1::NodeStatus_Name(node.status()) << " at '" << node.data_address()
              << "'): its registration is replaced";
    node = v1::Node();
  }
  node.set_node_id(req.node_id());
  node.set_data_address(req.data_address());
  node.set_capacity_bytes(req.capacity_bytes());
  node.set_status(v1::NODE_UP);
  node.set_last_heartbeat_unix_ms(now_ms);
  node.set_incarnation(req.incarnation());
  LOG(INFO) << "node " << req.node_id() << " registered at '" << req.data_address() << "'";
  RAGSHARD_RETURN_IF_ERROR(store_->PutNode(node));
  return lost;
}

absl::Status NodeRegistry::Heartbeat(const v1::HeartbeatRequest& req, int64_t now_ms) {
  absl::MutexLock lock(&mu_);
  auto it = nodes_.find(req.node_id());
  if (it == nodes_.end()) {
    return absl::NotFoundError(
        absl::StrCat("node '", req.node_id(), "' is not registered; call RegisterNode"));
  }
  v1::Node& node = it->second;
  RAGSHARD_RETURN_IF_ERROR(Stale(node, req.incarnation()));
  *node.mutable_figures() = req.figures();
  node.set_last_heartbeat_unix_ms(now_ms);
  if (node.status() != v1::NODE_UP) {
    node.set_status(v1::NODE_UP);
    (void)store_->PutNode(node);
    LOG(INFO) << "node " << node.node_id() << " is back";
  }
  return absl::OkStatus();
}

absl::Status NodeRegistry::Stale(const v1::Node& node, uint64_t incarnation) {
  if (node.incarnation() == 0 || incarnation == 0 || node.incarnation() == incarnation) {
    return absl::OkStatus();
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "node '", node.node_id(), "': this daemon (incarnation ", incarnation,
      ") is stale: another daemon (incarnation ", node.incarnation(), ", at '", node.data_address(),
      "') registered with its id while it was unreachable, and the node's "
      "jobs went on without it"));
}

absl::Status NodeRegistry::CheckIncarnation(const std::string& node_id,
                                            uint64_t incarnation) const {
  absl::MutexLock lock(&mu_);
  auto it = nodes_.find(node_id);
  return it == nodes_.end() ? absl::OkStatus() : Stale(it->second, incarnation);
}

std::vector<v1::Node> NodeRegistry::List() const {
  absl::MutexLock lock(&mu_);
  std::vector<v1::Node> out;
  out.reserve(nodes_.size());
  for (const auto& [id, node] : nodes_) out.push_back(node);
  return out;
}

std::vector<std::string> NodeRegistry::ExpireSilent(int64_t now_ms,
                                                    std::chrono::milliseconds timeout) {
  absl::MutexLock lock(&mu_);
  std::vector<std::string> lost;
  for (auto& [node_id, node] : nodes_) {
    if (node.status() != v1::NODE_UP || now_ms - node.last_heartbeat_unix_ms() <= timeout.count()) {
      continue;
    }
    node.set_status(v1::NODE_LOST);
    (void)store_->PutNode(node);
    LOG(WARNING) << "node " << node_id << " LOST: no heartbeat for "
                 << now_ms - node.last_heartbeat_unix_ms() << " ms";
    lost.push_back(node_id);
  }
  return lost;
}

std::map<v1::NodeStatus, int64_t> NodeRegistry::CountByStatus() const {
  absl::MutexLock lock(&mu_);
  std::map<v1::NodeStatus, int64_t> out;
  for (const auto& [id, node] : nodes_) ++out[node.status()];
  return out;
}

bool NodeRegistry::Up(const std::string& node_id) const {
  absl::MutexLock lock(&mu_);
  const auto it = nodes_.find(node_id);
  return it != nodes_.end() && it->second.status() == v1::NODE_UP;
}

size_t NodeRegistry::size() const {
  absl::MutexLock lock(&mu_);
  return nodes_.size();
}

}  // namespace ragshard::planner
