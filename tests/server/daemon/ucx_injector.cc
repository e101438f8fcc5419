// A stranger on a daemon's data port (issue 26's injection test, tests/python/test_access.py):
// connects to ADDRESS (IPv4:port) over UCX as a client, presenting CREDENTIAL (0: none), and for
// SECONDS sends small tagged messages shaped like the daemons' (ShapedTag),
// reconnecting whenever its endpoint fails. Prints one line: connections tried, messages sent,
// and send errors. Exits 0 unless it could not even start UCX.
//   ucx_injector ADDRESS SECONDS [CREDENTIAL]
#include <arpa/inet.h>
#include <netinet/in.h>
#include <ucp/api/ucp.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>

namespace {

bool failed = false;

// A tag shaped like the daemons' (server/daemon/ucx_comm.cc, comm.h MessageStamp): the source
// member in the top 16 bits (0 or 1), then a stamp whose index (16 bits) and kind (3 bits) a
// daemon's receive would match: a data message of a small index, or an abort notice.
uint64_t ShapedTag(std::mt19937_64& rng) {
  const uint64_t source = rng() % 2;
  uint64_t stamp = rng() & ((uint64_t{1} << 48) - 1) & ~uint64_t{0x7FFFF};
  if (rng() % 4 == 0) {
    stamp |= uint64_t{7} << 16 | 0xFFFF;  // an abort notice
  } else {
    stamp |= (1 + rng() % 2) << 16 | rng() % 8;  // all-gather or reduce-scatter, index < 8
  }
  return source << 48 | stamp;
}

void OnError(void*, ucp_ep_h, ucs_status_t) { failed = true; }

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3 || std::string(argv[1]) == "--help") {
    std::puts("usage: ucx_injector ADDRESS SECONDS [CREDENTIAL]");
    return argc < 3 ? 2 : 0;
  }
  const std::string address = argv[1];
  const double seconds = std::atof(argv[2]);
  const uint64_t credential = argc > 3 ? std::strtoull(argv[3], nullptr, 10) : 0;
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos ||
      inet_pton(AF_INET, address.substr(0, colon).c_str(), &sa.sin_addr) != 1) {
    std::fprintf(stderr, "error: bad address %s\n", address.c_str());
    return 2;
  }
  sa.sin_port = htons(static_cast<uint16_t>(std::atoi(address.c_str() + colon + 1)));
  ucp_config_t* config = nullptr;
  if (ucp_config_read(nullptr, nullptr, &config) != UCS_OK) return 1;
  ucp_config_modify(config, "TLS", "tcp");
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_TAG;
  ucp_context_h context = nullptr;
  const ucs_status_t init = ucp_init(&params, config, &context);
  ucp_config_release(config);
  if (init != UCS_OK) return 1;
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE | UCP_WORKER_PARAM_FIELD_CLIENT_ID;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;
  wp.client_id = credential;
  ucp_worker_h worker = nullptr;
  if (ucp_worker_create(context, &wp, &worker) != UCS_OK) return 1;
  std::mt19937_64 rng(std::random_device{}());
  char payload[4096];
  for (char& c : payload) c = static_cast<char>(rng());
  long connections = 0, sent = 0, errors = 0;
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < end) {
    ucp_ep_params_t ep_params{};
    ep_params.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                           UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep_params.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER |
                      (credential != 0 ? UCP_EP_PARAMS_FLAGS_SEND_CLIENT_ID : 0);
    ep_params.sockaddr.addr = reinterpret_cast<const sockaddr*>(&sa);
    ep_params.sockaddr.addrlen = sizeof(sa);
    ep_params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep_params.err_handler.cb = &OnError;
    ucp_ep_h ep = nullptr;
    failed = false;
    ++connections;
    if (ucp_ep_create(worker, &ep_params, &ep) != UCS_OK) {
      ++errors;
      continue;
    }
    // Messages of any source and stamp, sizes up to 4 KiB, until the endpoint fails.
    for (int i = 0; i < 2000 && !failed && std::chrono::steady_clock::now() < end; ++i) {
      ucp_request_param_t param{};
      void* req =
          ucp_tag_send_nbx(ep, payload, 1 + rng() % sizeof(payload), ShapedTag(rng), &param);
      if (UCS_PTR_IS_ERR(req)) {
        ++errors;
        break;
      }
      if (req != nullptr) {
        while (ucp_request_check_status(req) == UCS_INPROGRESS && !failed &&
               std::chrono::steady_clock::now() < end) {
          ucp_worker_progress(worker);
        }
        if (ucp_request_check_status(req) != UCS_OK) ++errors;
        ucp_request_free(req);
      }
      ++sent;
    }
    ucp_request_param_t close{};
    close.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    close.flags = UCP_EP_CLOSE_FLAG_FORCE;
    void* req = ucp_ep_close_nbx(ep, &close);
    if (UCS_PTR_IS_PTR(req)) {
      while (ucp_request_check_status(req) == UCS_INPROGRESS) ucp_worker_progress(worker);
      ucp_request_free(req);
    }
  }
  std::printf("injector: %ld connections, %ld messages sent, %ld errors\n", connections, sent,
              errors);
  ucp_worker_destroy(worker);
  ucp_cleanup(context);
  return 0;
}
