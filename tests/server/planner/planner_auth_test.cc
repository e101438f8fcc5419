// Bearer tokens, the admin token, TLS and mutual TLS, through the real planner binary, the
// library client and ragshardctl.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "protocol/planner_client.h"
#include "server/planner/server.h"
#include "tests/testing/test_util.h"

namespace ragshard {
namespace {

using ::testing::HasSubstr;
using namespace std::chrono_literals;

ClientSecurityOptions TokenOnly(const std::string& path) {
  ClientSecurityOptions o;
  o.token_file = path;
  return o;
}

std::unique_ptr<GrpcPlannerClient> Connect(const std::string& address,
                                           ClientSecurityOptions security) {
  PlannerClientOptions o;
  o.address = address;
  o.security = std::move(security);
  o.rpc_timeout = 5s;
  // A refused TLS handshake is UNAVAILABLE, as a restarting planner is: one attempt, so that
  // the refusals are seen at once rather than after the retry window.
  o.retry_window = 0s;
  auto c = GrpcPlannerClient::Create(o);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? std::move(*c) : nullptr;
}

struct Ctl {
  int code;
  std::string out, err;
};

Ctl RunCtl(const testing::TempDir& dir, const std::string& args) {
  const std::string out = dir.path() + "/ctl.out", err = dir.path() + "/ctl.err";
  int status =
      std::system((std::string(RAGSHARDCTL_PATH) + " " + args + " >" + out + " 2>" + err).c_str());
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, testing::ReadAll(out),
          testing::ReadAll(err)};
}

v1::CreateJobRequest Job(const std::string& id) {
  v1::CreateJobRequest r;
  r.set_job_id(id);
  r.mutable_mesh()->set_shard_size(2);
  r.mutable_mesh()->set_replicate_size(1);
  return r;
}

TEST(PlannerAuthTest, TokensAreRequiredAndDeleteNeedsTheAdminToken) {
  testing::TempDir dir;
  const std::string token = dir.File("token", "s3cret-user\n");
  const std::string admin = dir.File("admin", "s3cret-admin\n");
  const std::string wrong = dir.File("wrong", "guess\n");
  auto p = testing::PlannerProcess::Start(RAGSHARD_PLANNER_PATH, dir.path(),
                                          {"--token-file", token, "--admin-token-file", admin});
  ASSERT_FALSE(p.address.empty()) << testing::ReadAll(dir.path() + "/planner.log");

  auto anonymous = Connect(p.address, {});
  EXPECT_EQ(anonymous->ListJobs().status().code(), absl::StatusCode::kUnauthenticated);
  auto guesser = Connect(p.address, TokenOnly(wrong));
  EXPECT_EQ(guesser->CreateJob(Job("x")).status().code(), absl::StatusCode::kUnauthenticated);

  auto user = Connect(p.address, TokenOnly(token));
  ASSERT_TRUE(user->CreateJob(Job("a")).ok());
  EXPECT_EQ(user->ListJobs()->size(), 1u);
  EXPECT_EQ(user->DeleteJob("a").code(), absl::StatusCode::kPermissionDenied);
  auto root = Connect(p.address, TokenOnly(admin));
  EXPECT_TRUE(root->DeleteJob("a").ok());

  // Watches are authenticated too.
  ASSERT_TRUE(user->CreateJob(Job("b")).ok());
  auto plan = anonymous->WaitForPlan("b", 5s);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kUnauthenticated);

  // ragshardctl: the same flags; a refused token is one line and exit code 1.
  Ctl ok = RunCtl(dir, "jobs --planner " + p.address + " --token-file " + token);
  EXPECT_EQ(ok.code, 0) << ok.err;
  EXPECT_THAT(ok.out, HasSubstr("b"));
  // RAGSHARD_TOKEN_FILE stands for --token-file.
  ::setenv("RAGSHARD_TOKEN_FILE", token.c_str(), 1);
  Ctl from_env = RunCtl(dir, "jobs --planner " + p.address);
  ::unsetenv("RAGSHARD_TOKEN_FILE");
  EXPECT_EQ(from_env.code, 0) << from_env.err;
  EXPECT_THAT(from_env.out, HasSubstr("b"));
  Ctl refused = RunCtl(dir, "jobs --planner " + p.address + " --token-file " + wrong);
  EXPECT_EQ(refused.code, 1);
  EXPECT_THAT(refused.err, HasSubstr("invalid bearer token"));
  EXPECT_EQ(std::count(refused.err.begin(), refused.err.end(), '\n'), 1);
  Ctl missing =
      RunCtl(dir, "jobs --planner " + p.address + " --token-file " + dir.path() + "/nope");
  EXPECT_NE(missing.code, 0);
  EXPECT_THAT(missing.err, HasSubstr("nope"));
}

TEST(PlannerAuthTest, TokenFilesOthersCanReadAreRefusedNamingTheFileAndTheMode) {
  testing::TempDir dir;
  const std::string open_token = dir.File("token", "s3cret\n", 0644);
  const std::string log = dir.path() + "/planner.out";
  const int rc =
      std::system((std::string(RAGSHARD_PLANNER_PATH) + " --listen 127.0.0.1:0" + " --data-dir " +
                   dir.path() + " --token-file " + open_token + " >" + log + " 2>&1")
                      .c_str());
  EXPECT_EQ(WEXITSTATUS(rc), 2);
  const std::string err = testing::ReadAll(log);
  EXPECT_THAT(err, HasSubstr("token file '" + open_token + "' is open to other users (mode 0644)"));
  EXPECT_THAT(err, HasSubstr("chmod 600"));
  // The clients read tokens through the same function: ragshardctl refuses it too.
  Ctl ctl = RunCtl(dir, "jobs --planner 127.0.0.1:1 --token-file " + open_token);
  EXPECT_NE(ctl.code, 0);
  EXPECT_THAT(ctl.err, HasSubstr("is open to other users (mode 0644)"));
}

TEST(PlannerAuthTest, ListeningBeyondLoopbackWithoutTlsIsRefusedUnlessInsecure) {
  for (const char* local :
       {"127.0.0.1:0", "127.0.0.53:7070", "localhost:0", "[::1]:0", "unix:/tmp/planner.sock"}) {
    EXPECT_TRUE(planner::IsLoopbackListen(local)) << local;
  }
  for (const char* remote : {"0.0.0.0:7070", "[::]:7070", "10.1.2.3:7070", "planner:7070"}) {
    EXPECT_FALSE(planner::IsLoopbackListen(remote)) << remote;
  }
  testing::TempDir dir;
  planner::PlannerServerOptions o;
  o.listen = "0.0.0.0:0";
  o.data_dir = dir.path();
  auto server = planner::PlannerServer::Start(o);
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(server.status().message(), HasSubstr("--listen 0.0.0.0:0 reaches beyond"));
  EXPECT_THAT(server.status().message(), HasSubstr("--insecure"));
  // (Not started with --insecure here: that would open a port beyond this machine.)
}

class TlsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string d = dir_.path();
    const std::string script =
        "cd '" + d +
        "' && "
        "openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 1 "
        "-subj /CN=ragshard-test-ca && "
        "printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\\n' > san.ext && "
        "for n in server client; do "
        "openssl req -newkey rsa:2048 -nodes -keyout $n.key -out $n.csr -subj /CN=$n && "
        "openssl x509 -req -in $n.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out $n.pem "
        "-days 1 -extfile san.ext; done";
    ASSERT_EQ(std::system(("(" + script + ") >/dev/null 2>&1").c_str()), 0);
  }
  std::string F(const std::string& name) const { return dir_.path() + "/" + name; }
  testing::TempDir dir_;
};

TEST_F(TlsTest, ServerTlsAndMutualTls) {
  auto p = testing::PlannerProcess::Start(RAGSHARD_PLANNER_PATH, dir_.path(),
                                          {"--tls-cert", F("server.pem"), "--tls-key",
                                           F("server.key"), "--tls-client-ca", F("ca.pem")});
  ASSERT_FALSE(p.address.empty()) << testing::ReadAll(dir_.path() + "/planner.log");

  // Each client presents the planner's own token (DATA_DIR/token): what it lacks is TLS's.
  ClientSecurityOptions mtls = TokenOnly(p.token_file);
  mtls.tls_ca_file = F("ca.pem");
  mtls.tls_cert_file = F("client.pem");
  mtls.tls_key_file = F("client.key");
  auto good = Connect(p.address, mtls);
  ASSERT_TRUE(good->CreateJob(Job("tls")).ok());
  EXPECT_TRUE(good->Health().ok());

  ClientSecurityOptions no_cert = TokenOnly(p.token_file);
  no_cert.tls_ca_file = F("ca.pem");
  EXPECT_FALSE(Connect(p.address, no_cert)->ListJobs().ok());
  // Plaintext to a TLS port.
  EXPECT_FALSE(Connect(p.address, TokenOnly(p.token_file))->ListJobs().ok());

  Ctl ok = RunCtl(dir_, "jobs --planner " + p.address + " --tls-ca " + F("ca.pem") +
                            " --tls-cert " + F("client.pem") + " --tls-key " + F("client.key"));
  EXPECT_EQ(ok.code, 0) << ok.err;
  EXPECT_THAT(ok.out, HasSubstr("tls"));
}

TEST_F(TlsTest, ServerOnlyTls) {
  auto p =
      testing::PlannerProcess::Start(RAGSHARD_PLANNER_PATH, dir_.path(),
                                     {"--tls-cert", F("server.pem"), "--tls-key", F("server.key")});
  ASSERT_FALSE(p.address.empty());
  ClientSecurityOptions tls = TokenOnly(p.token_file);  // the planner's own token
  tls.tls_ca_file = F("ca.pem");
  EXPECT_TRUE(Connect(p.address, tls)->ListJobs().ok());
  ClientSecurityOptions wrong_ca = TokenOnly(p.token_file);
  wrong_ca.tls_ca_file = F("client.pem");  // not the CA that signed the server
  EXPECT_FALSE(Connect(p.address, wrong_ca)->ListJobs().ok());
}

}  // namespace
}  // namespace ragshard
