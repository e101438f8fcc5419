// ragshard._core: the client library for Python. numpy arrays view the daemon's buffers without
// copying (their base object keeps the client, hence the mapping, alive); bf16 and fp16 buffers
// are uint16 arrays, to be viewed with torch's .view(torch.bfloat16). Calls that wait release
// the GIL. Errors raise ragshard.Error with the status code's name first.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/device_memory.h"
#include "common/data_plane_memory.h"
#include "common/dtype.h"
#include "common/inventory.h"
#include "common/planner.h"
#include "google/protobuf/util/json_util.h"

namespace py = pybind11;

namespace ragshard {
namespace {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

void Check(const absl::Status& s) {
  if (!s.ok()) throw Error(absl::StrCat(absl::StatusCodeToString(s.code()), ": ", s.message()));
}
template <typename T>
T Check(absl::StatusOr<T> v) {
  Check(v.status());
  return std::move(*v);
}

std::shared_ptr<PlannerClient> Planner(const std::string& address, const std::string& token_file) {
  PlannerClientOptions o;
  o.address = address;
  o.security.token_file = token_file;
  return std::shared_ptr<PlannerClient>(Check(GrpcPlannerClient::Create(std::move(o))));
}

v1::ReduceKind ParseReduce(const std::string& op) {
  if (op == "avg") return v1::REDUCE_AVG;
  if (op == "sum") return v1::REDUCE_SUM;
  throw py::value_error("op: '" + op + "' is not one of avg, sum");
}

class PyClient;

// A daemon buffer in device memory: `__cuda_array_interface__` (version 3) lets torch build a
// CUDA tensor on it without a copy (torch.as_tensor(buffer, device="cuda")). It keeps its
// client, and so the mapping of the slab, alive.
struct DeviceBuffer {
  std::shared_ptr<PyClient> owner;
  uintptr_t ptr = 0;
  int64_t count = 0;
  std::string typestr;
  int device = 0;

  py::dict Interface() const {
    py::dict d;
    d["shape"] = py::make_tuple(count);
    d["typestr"] = typestr;
    d["data"] = py::make_tuple(ptr, false);
    d["strides"] = py::none();
    d["version"] = 3;
    return d;
  }
};

class PyHandle {
 public:
  PyHandle(std::shared_ptr<PyClient> owner, OpHandle handle)
      : owner_(std::move(owner)), handle_(handle) {}
  void Wait(int64_t timeout_ms) {
    absl::Status s;
    {
      py::gil_scoped_release release;
      s = handle_.Wait(std::chrono::milliseconds(timeout_ms));
    }
    Check(s);
  }
  bool Poll() { return Check(handle_.Poll()); }

 private:
  std::shared_ptr<PyClient> owner_;  // keeps the client alive while the handle exists
  OpHandle handle_;
};

class PyClient : public std::enable_shared_from_this<PyClient> {
 public:
  PyClient(const std::string& planner, const std::string& socket, const std::string& job,
           int64_t rank, const std::string& node, int64_t timeout_ms, const std::string& token_file,
           const std::string& device_memory)
      : device_memory_(device_memory) {
    if (device_memory_ != "auto" && device_memory_ != "fake") {
      throw py::value_error("device_memory: '" + device_memory + "' is not one of auto, fake");
    }
    ClientOptions o;
    o.planner = Planner(planner, token_file);
    o.daemon_socket = socket;
    o.job_id = job;
    o.rank = rank;
    o.node_id = node;
    o.timeout = std::chrono::milliseconds(timeout_ms);
    client_ = Check(Client::Create(std::move(o)));
  }

  void Register(const std::string& inventory_json, bool send_full) {
    Inventory inv = Check(ParseInventoryJson(inventory_json));
    absl::Status s;
    {
      py::gil_scoped_release release;
      s = client_->Register(inv, send_full);
    }
    Check(s);
  }
  void Attach() {
    absl::Status s;
    {
      py::gil_scoped_release release;
      s = client_->Attach();
    }
    Check(s);
  }
  std::string PlanJson() const {
    std::string out;
    google::protobuf::util::JsonPrintOptions opt;
    opt.preserve_proto_field_names = true;
    opt.always_print_primitive_fields = true;
    Check(absl::Status(
        static_cast<absl::StatusCode>(
            google::protobuf::util::MessageToJsonString(client_->plan(), &out, opt).code()),
        "plan to JSON"));
    return out;
  }
  int Units() const { return client_->units(); }
  int64_t WorldSize() const { return client_->plan().world_size(); }
  int64_t Replicas() const { return client_->replicas(); }
  int64_t Rank() const { return client_->rank(); }
  std::string UnitDType(int u) const {
    CheckUnit(u);
    return std::string(DTypeName(client_->buffers(u).dtype()));
  }
  int64_t ShardElems(int u) const {
    CheckUnit(u);
    return client_->buffers(u).shard_elems();
  }

  // Views of a unit's buffer. kind: 0 param shard, 1 unsharded, 2 grad, 3 grad shard, 4 owner
  // buffer. numpy arrays over the mapped arena (host backends), or DeviceBuffers over the GPU
  // slab (the cuda backend; with device_memory "fake", over the host arena, so that the device
  // path's pointers, shapes and types are checked where there is no GPU).
  py::object Buffer(int u, int kind) {
    CheckUnit(u);
    const v1::UnitBuffers& b = client_->buffers(u);
    const int64_t s = b.shard_elems(), w = client_->plan().world_size();
    int64_t offset = 0, count = 0;
    switch (kind) {
      case 0:
        offset = b.param_shard_offset(), count = s;
        break;
      case 1:
        offset = b.unsharded_offset(), count = w * s;
        if (offset < 0)
          Check(absl::FailedPreconditionError(
              Transient(b, "unsharded parameters", "unshard to reshard")));
        break;
      case 2:
        offset = b.grad_offset(), count = w * s;
        if (offset < 0)
          Check(absl::FailedPreconditionError(
              Transient(b, "unsharded gradients", "allocate_grad to the end of reduce_scatter")));
        break;
      case 3:
        offset = b.grad_shard_offset(), count = s;
        break;
      default:
        if (b.owner_elems() == 0) return py::none();
        offset = b.owner_offset(), count = b.owner_elems();
        if (offset < 0)
          Check(absl::FailedPreconditionError(
              Transient(b, "owner buffer", "gather_to_owner to scatter_from_owner")));
    }
    // Element type as numpy names it (bf16/fp16 as uint16, 8-bit types as uint8).
    const v1::DType d = kind >= 3 ? v1::DTYPE_FP32 : b.dtype();
    std::string typestr;
    if (d == v1::DTYPE_FP32) {
      typestr = "<f4";
    } else if (d == v1::DTYPE_BF16 || d == v1::DTYPE_FP16) {
      typestr = "<u2";
    } else if (d == v1::DTYPE_UINT8 || d == v1::DTYPE_INT8 || d == v1::DTYPE_FP8E4M3 ||
               d == v1::DTYPE_FP8E5M2) {
      typestr = "|u1";
    } else {
      Check(absl::UnimplementedError(absl::StrCat("no array view for dtype ", DTypeName(d))));
    }
    if (client_->backend() == "cuda" || device_memory_ == "fake") {
      DeviceBuffer out;
      out.owner = shared_from_this();
      out.ptr = DeviceBase() + static_cast<uintptr_t>(offset);
      out.count = count;
      out.typestr = typestr;
      out.device = client_->cuda_device();
      return py::cast(out);
    }
    char* p = const_cast<char*>(client_->arena()) + offset;
    py::object base = py::cast(shared_from_this());
    if (typestr == "<f4")
      return py::array_t<float>({count}, {sizeof(float)}, reinterpret_cast<float*>(p), base);
    if (typestr == "<u2") {
      return py::array_t<uint16_t>({count}, {sizeof(uint16_t)}, reinterpret_cast<uint16_t*>(p),
                                   base);
    }
    return py::array_t<uint8_t>({count}, {sizeof(uint8_t)}, reinterpret_cast<uint8_t*>(p), base);
  }

  // Offset 0 of the buffers' memory as a device address: the daemon's GPU slab opened from its
  // IPC handle (once), or the host arena with device_memory "fake".
  uintptr_t DeviceBase() {
    if (device_memory_ == "fake") return reinterpret_cast<uintptr_t>(client_->arena());
    if (mapping_ == nullptr) {
      mapping_ = Check(OpenCudaIpc(client_->cuda_device(), client_->cuda_ipc_handle()));
    }
    return mapping_->base();
  }

  static std::string Transient(const v1::UnitBuffers& b, const char* what, const char* when) {
    return absl::StrCat("unit '", b.unit(), "' has no ", what, " now: they exist from ", when,
                        " (transient buffers, docs/daemon.md)");
  }

  PyHandle Op(const std::string& kind, int u, const std::string& op, int keep = 0) {
    // GPU buffers: torch's kernels that write them are queued on torch's streams; the daemon's
    // operation must see what they wrote.
    if (mapping_ != nullptr) Check(mapping_->Synchronize());
    absl::StatusOr<OpHandle> h;
    if (kind == "unshard") {
      h = client_->Unshard(u);
    } else if (kind == "allocate_unsharded") {
      h = client_->AllocateUnsharded(u);
    } else if (kind == "allocate_grad") {
      h = client_->AllocateGrad(u);
    } else if (kind == "reshard") {
      h = client_->Reshard(u, keep);
    } else if (kind == "reduce_scatter") {
      h = client_->ReduceScatter(u, ParseReduce(op));
    } else if (kind == "all_reduce") {
      h = client_->AllReduce(u, ParseReduce(op));
    } else if (kind == "gather_to_owner") {
      h = client_->GatherToOwner(u);
    } else if (kind == "scatter_from_owner") {
      h = client_->ScatterFromOwner(u);
    } else {
      throw py::value_error("unknown operation '" + kind + "'");
    }
    return PyHandle(shared_from_this(), Check(std::move(h)));
  }

  void NoOp() { Check(client_->NoOp()); }
  py::dict Stats() {
    v1::StatsResponse s = Check(client_->DaemonStats());
    py::dict d;
    d["pool_capacity"] = s.pool_capacity();
    d["pool_used"] = s.pool_used();
    d["pool_peak"] = s.pool_peak();
    d["pool_fragmentation"] = s.pool_fragmentation();
    for (const auto& j : s.jobs()) {
      if (j.job_id() == client_->job_id()) {
        d["staging_bytes"] = j.staging_bytes();
        d["operations"] = j.operations();
      }
    }
    return d;
  }

 private:
  void CheckUnit(int u) const {
    if (u < 0 || u >= client_->units()) {
      throw py::index_error(
          absl::StrCat("unit ", u, " does not exist (", client_->units(), " units)"));
    }
  }
  std::string device_memory_;  // "auto" or "fake"
  std::unique_ptr<Client> client_;
  std::unique_ptr<DeviceMapping> mapping_;  // the GPU slab, once opened
};

// Creates a job (ALREADY_EXISTS is an error too: the caller decides).
std::string CreateJob(const std::string& planner, const std::string& job, int64_t shard_size,
                      int64_t replicate_size, const std::string& policy,
                      const std::string& default_granule, const std::string& token_file,
                      const std::string& strategy, int64_t memory_budget_bytes,
                      const std::string& optimizer, int64_t tokens_per_step) {
  v1::CreateJobRequest req;
  req.set_job_id(job);
  req.mutable_mesh()->set_shard_size(shard_size);
  req.mutable_mesh()->set_replicate_size(replicate_size);
  req.mutable_options()->set_policy(policy);
  req.mutable_options()->set_default_granule(default_granule);
  req.mutable_options()->set_strategy(strategy);
  req.mutable_options()->set_memory_budget_bytes(memory_budget_bytes);
  req.mutable_options()->set_optimizer(optimizer);
  req.mutable_options()->set_tokens_per_step(tokens_per_step);
  auto p = Planner(planner, token_file);
  absl::StatusOr<v1::Job> j;
  {
    py::gil_scoped_release release;
    j = p->CreateJob(req);
  }
  return Check(std::move(j)).job_id();
}

// The plan the planner would compute for `inventory_json` (the planners are deterministic), as
// protobuf JSON: lets a client size buffers that depend on the shard sizes before registering.
std::string PlanLocal(const std::string& inventory_json, int64_t world, const std::string& policy,
                      int32_t align_bytes) {
  Inventory inv = Check(ParseInventoryJson(inventory_json));
  PlanOptions o;
  auto p = ParsePolicy(policy);
  if (!p.ok()) throw py::value_error(std::string(p.status().message()));
  o.policy = *p;
  o.world = world;
  o.align_bytes = align_bytes;
  v1::Plan plan = Check(BuildPlan(inv, o));
  std::string out;
  google::protobuf::util::JsonPrintOptions opt;
  opt.preserve_proto_field_names = true;
  opt.always_print_primitive_fields = true;
  (void)google::protobuf::util::MessageToJsonString(plan, &out, opt);
  return out;
}

void DeleteJob(const std::string& planner, const std::string& job, const std::string& token_file) {
  Check(Planner(planner, token_file)->DeleteJob(job));
}

}  // namespace
}  // namespace ragshard

PYBIND11_MODULE(_core, m) {
  using namespace ragshard;
  m.doc() = "ragshard client library (C++ core)";
  py::register_exception<Error>(m, "Error", PyExc_RuntimeError);
  py::class_<PyHandle>(m, "Handle")
      .def("wait", &PyHandle::Wait, py::arg("timeout_ms") = 60000)
      .def("poll", &PyHandle::Poll);
  py::class_<DeviceBuffer>(m, "DeviceBuffer",
                           "A daemon buffer in device memory; torch.as_tensor(b, device='cuda') "
                           "builds a tensor on it without a copy.")
      .def_property_readonly("__cuda_array_interface__", &DeviceBuffer::Interface)
      .def_readonly("device", &DeviceBuffer::device)
      .def_readonly("ptr", &DeviceBuffer::ptr)
      .def("__len__", [](const DeviceBuffer& b) { return b.count; });
  py::class_<PyClient, std::shared_ptr<PyClient>>(m, "Client")
      .def(py::init<const std::string&, const std::string&, const std::string&, int64_t,
                    const std::string&, int64_t, const std::string&, const std::string&>(),
           py::arg("planner"), py::arg("socket"), py::arg("job"), py::arg("rank"),
           py::arg("node") = "", py::arg("timeout_ms") = 60000, py::arg("token_file") = "",
           py::arg("device_memory") = "auto")
      .def("register", &PyClient::Register, py::arg("inventory_json"), py::arg("send_full") = true)
      .def("attach", &PyClient::Attach)
      .def("plan_json", &PyClient::PlanJson)
      .def_property_readonly("units", &PyClient::Units)
      .def_property_readonly("world_size", &PyClient::WorldSize)
      .def_property_readonly("replicas", &PyClient::Replicas)
      .def_property_readonly("rank", &PyClient::Rank)
      .def("unit_dtype", &PyClient::UnitDType)
      .def("shard_elems", &PyClient::ShardElems)
      .def("param_shard", [](PyClient& c, int u) { return c.Buffer(u, 0); })
      .def("unsharded", [](PyClient& c, int u) { return c.Buffer(u, 1); })
      .def("grad", [](PyClient& c, int u) { return c.Buffer(u, 2); })
      .def("grad_shard", [](PyClient& c, int u) { return c.Buffer(u, 3); })
      .def("owner_buffer", [](PyClient& c, int u) { return c.Buffer(u, 4); })
      .def("unshard", [](PyClient& c, int u) { return c.Op("unshard", u, "sum"); })
      .def(
          "reshard", [](PyClient& c, int u, int keep) { return c.Op("reshard", u, "sum", keep); },
          py::arg("unit"), py::arg("keep") = 0)
      .def("allocate_unsharded",
           [](PyClient& c, int u) { return c.Op("allocate_unsharded", u, "sum"); })
      .def("allocate_grad", [](PyClient& c, int u) { return c.Op("allocate_grad", u, "sum"); })
      .def(
          "reduce_scatter",
          [](PyClient& c, int u, const std::string& op) { return c.Op("reduce_scatter", u, op); },
          py::arg("unit"), py::arg("op") = "avg")
      .def(
          "all_reduce",
          [](PyClient& c, int u, const std::string& op) { return c.Op("all_reduce", u, op); },
          py::arg("unit"), py::arg("op") = "avg")
      .def("gather_to_owner", [](PyClient& c, int u) { return c.Op("gather_to_owner", u, ""); })
      .def("scatter_from_owner",
           [](PyClient& c, int u) { return c.Op("scatter_from_owner", u, ""); })
      .def("noop", &PyClient::NoOp)
      .def("stats", &PyClient::Stats);
  m.def("create_job", &CreateJob, py::arg("planner"), py::arg("job"), py::arg("shard_size"),
        py::arg("replicate_size") = 1, py::arg("policy") = "ragged",
        py::arg("default_granule") = "", py::arg("token_file") = "", py::arg("strategy") = "",
        py::arg("memory_budget_bytes") = 0, py::arg("optimizer") = "",
        py::arg("tokens_per_step") = 0);
  m.def("plan_local", &PlanLocal, py::arg("inventory_json"), py::arg("world"),
        py::arg("policy") = "ragged", py::arg("align_bytes") = 16);
  m.def(
      "data_plane_peak",
      [](const std::vector<std::tuple<int64_t, int64_t, double>>& units, int64_t ranks, bool shared,
         int64_t prefetch) {
        std::vector<DataPlaneUnit> in;
        for (const auto& [s, f, bytes] : units) in.push_back({s, f, bytes});
        const DataPlaneMemory m = DataPlanePeak(in, ranks, shared, prefetch);
        py::dict d;
        d["shards"] = m.shards;
        d["grad_shards"] = m.grad_shards;
        d["unsharded"] = m.unsharded;
        d["grads"] = m.grads;
        d["total"] = m.total();
        return d;
      },
      "The data plane's peak bytes (common/data_plane_memory.h), as the strategy model counts "
      "it: units as (shard_elems, shard group size, parameter bytes per element).",
      py::arg("units"), py::arg("ranks"), py::arg("shared"), py::arg("prefetch"));
  m.def("delete_job", &DeleteJob, py::arg("planner"), py::arg("job"), py::arg("token_file") = "");
}
