/* A native backtrace on SIGSEGV / SIGBUS / SIGABRT for diagnosing crashes inside C++ extensions (used by
 * scripts/hybridep_probe.py through LD_PRELOAD). Prints the frames to stderr, then re-raises the signal with
 * the default action so the exit status still says which signal it was. */
#define _GNU_SOURCE
#include <execinfo.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static void on_fatal(int sig, siginfo_t *info, void *ctx) {
  (void)ctx;
  void *frames[64];
  char line[160];
  int n = backtrace(frames, 64);
  int len = snprintf(line, sizeof line, "segv_backtrace: signal %d (%s) at address %p, %d frames:\n", sig,
                     strsignal(sig), info ? info->si_addr : NULL, n);
  if (len > 0) (void)write(STDERR_FILENO, line, (size_t)len);
  backtrace_symbols_fd(frames, n, STDERR_FILENO);
  signal(sig, SIG_DFL);
  raise(sig);
}

__attribute__((constructor)) static void install_handlers(void) {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_fatal;
  sa.sa_flags = SA_SIGINFO | SA_RESETHAND;
  sigaction(SIGSEGV, &sa, NULL);
  sigaction(SIGBUS, &sa, NULL);
  sigaction(SIGABRT, &sa, NULL);
}
