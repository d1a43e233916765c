#include "capture/dump_signal.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <mutex>
#include <thread>

#include "base/base.h"
#include "capture/flight_recorder.h"
#include "capture/trace_writer.h"

namespace magi::capture {
namespace {

int g_pipe[2] = {-1, -1};
pid_t g_armed_pid = 0;  // a forked child inherits the handler, not the thread: it does nothing
struct sigaction g_previous {};

void on_signal(int signo, siginfo_t* info, void* context) {
  const int saved = errno;
  if (getpid() == g_armed_pid) {
    const char byte = 1;
    [[maybe_unused]] const ssize_t n = write(g_pipe[1], &byte, 1);  // full pipe: a dump pends
  }
  errno = saved;
  if (g_previous.sa_flags & SA_SIGINFO) {
    if (g_previous.sa_sigaction != nullptr) g_previous.sa_sigaction(signo, info, context);
  } else if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN) {
    g_previous.sa_handler(signo);
  }
}

void serve_dumps() {
  pthread_setname_np(pthread_self(), "magice-dump");
  for (;;) {
    char bytes[64];
    const ssize_t n = read(g_pipe[0], bytes, sizeof(bytes));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    trace_flush_if_open();
    flight_sync();
    MAGI_INFO(Trace, "dump signal: trace written out, flight recorder synced");
  }
}

}  // namespace

void arm_dump_signal() {
  static std::once_flag armed;
  std::call_once(armed, [] {
    const Options::DumpSignal which = Options::get().dump_signal;
    if (which == Options::DumpSignal::None) return;
    const int signo = which == Options::DumpSignal::Usr1 ? SIGUSR1 : SIGUSR2;
    if (pipe2(g_pipe, O_CLOEXEC) != 0 || fcntl(g_pipe[1], F_SETFL, O_NONBLOCK) != 0) {
      MAGI_WARN(Trace, "MAGI_DUMP_SIGNAL: no pipe (%s); the signal is not handled",
                std::strerror(errno));
      return;
    }
    g_armed_pid = getpid();
    std::thread(serve_dumps).detach();
    struct sigaction action {};
    action.sa_sigaction = on_signal;
    action.sa_flags = SA_SIGINFO | SA_RESTART;
    sigemptyset(&action.sa_mask);
    if (sigaction(signo, &action, &g_previous) != 0) {
      MAGI_WARN(Trace, "MAGI_DUMP_SIGNAL: cannot handle SIG%s (%s)",
                signo == SIGUSR1 ? "USR1" : "USR2", std::strerror(errno));
      return;
    }
    MAGI_INFO(Trace, "SIG%s writes out the trace and syncs the flight recorder",
              signo == SIGUSR1 ? "USR1" : "USR2");
  });
}

}  // namespace magi::capture
