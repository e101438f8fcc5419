#include "server/daemon/cuda/nccl_api.h"

#include <dlfcn.h>
#include <link.h>

#include <cstdlib>
#include <type_traits>

#include "absl/strings/str_cat.h"

namespace ragshard::gpu {
absl::StatusOr<NcclApi> OpenNccl(const std::string& file) {
  void* lib = dlopen(file.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* err = dlerror();
    return absl::FailedPreconditionError(
        absl::StrCat("NCCL could not be opened from '", file, "' (", err ? err : "unknown error",
                     "); set ", kNcclLibraryEnv,
                     " to its libnccl.so.2, for example the one of the "
                     "nvidia-nccl wheel beside torch"));
  }
  NcclApi api{};
  absl::Status missing;
  auto bind = [&](auto& fn, const char* name) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
    if (fn == nullptr && missing.ok()) {
      missing = absl::FailedPreconditionError(
          absl::StrCat("NCCL at '", file, "' has no ", name, ": too old or not NCCL"));
    }
  };
  bind(api.GetVersion, "ncclGetVersion");
  bind(api.GetErrorString, "ncclGetErrorString");
  bind(api.GetUniqueId, "ncclGetUniqueId");
  bind(api.CommInitRank, "ncclCommInitRank");
  bind(api.CommAbort, "ncclCommAbort");
  bind(api.CommDestroy, "ncclCommDestroy");
  bind(api.CommGetAsyncError, "ncclCommGetAsyncError");
  bind(api.GroupStart, "ncclGroupStart");
  bind(api.GroupEnd, "ncclGroupEnd");
  bind(api.AllGather, "ncclAllGather");
  bind(api.ReduceScatter, "ncclReduceScatter");
  bind(api.AllReduce, "ncclAllReduce");
  bind(api.Send, "ncclSend");
  bind(api.Recv, "ncclRecv");
  if (!missing.ok()) {
    dlclose(lib);
    return missing;
  }
  // Where the loader found it, for the logs and the GPU bundle's summary.
  link_map* map = nullptr;
  api.path = dlinfo(lib, RTLD_DI_LINKMAP, &map) == 0 && map != nullptr && map->l_name != nullptr
                 ? map->l_name
                 : file;
  return api;  // the library stays open for the process's life
}

absl::StatusOr<const NcclApi*> Nccl() {
  static const absl::StatusOr<NcclApi>* const api = new absl::StatusOr<NcclApi>([] {
    const char* env = std::getenv(kNcclLibraryEnv);
    return OpenNccl(env != nullptr && *env != '\0' ? env : "libnccl.so.2");
  }());
  if (!api->ok()) return api->status();
  return &**api;
}

}  // namespace ragshard::gpu
