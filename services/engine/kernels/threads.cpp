// Pinning the calling thread's OpenMP team, one thread per CPU (services/engine/threads.py).
//
// libgomp hands the same pool threads to every team a thread opens (team member i is pool
// thread i), so pinning member i once keeps it on its CPU for every later region of that size
// or smaller; vLLM's CPU worker pins its team the same way (init_cpu_threads_env).
#include <omp.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <stdexcept>
#include <vector>

// Runs one parallel region of cpu_ids.size() threads on the calling thread's team; member i
// binds itself to cpu_ids[i]. Returns each member's Linux thread id (member 0: the caller).
// Throws std::runtime_error when a member cannot be bound (a CPU outside the process's mask).
//
// A member libgomp creates for a larger team starts with its creator's affinity. Had the
// caller been bound to its own CPU alone, the new member would run on that CPU beside it until
// it bound itself: two running compute threads on one core, for as long as the thread's start
// takes. So the caller first widens its mask to all of cpu_ids (the kernel starts the new
// thread on the idlest of them, the one just lent), and binds itself to cpu_ids[0] in the
// region like every other member.
std::vector<int64_t> pin_omp_threads(const std::vector<int64_t>& cpu_ids) {
  const int n = static_cast<int>(cpu_ids.size());
  if (n < 1) throw std::runtime_error("pin_omp_threads: need at least one CPU");
  std::vector<int64_t> tids(n, -1);
  std::vector<int> errors(n, 0);
  cpu_set_t team;
  CPU_ZERO(&team);
  for (const int64_t cpu : cpu_ids) CPU_SET(static_cast<int>(cpu), &team);
  if (sched_setaffinity(0, sizeof(team), &team) != 0) {
    throw std::runtime_error("pin_omp_threads: could not widen the caller to its team's CPUs");
  }
  omp_set_num_threads(n);
#pragma omp parallel num_threads(n)
  {
    const int i = omp_get_thread_num();
    if (i < n) {
      cpu_set_t mask;
      CPU_ZERO(&mask);
      CPU_SET(static_cast<int>(cpu_ids[i]), &mask);
      errors[i] = sched_setaffinity(0, sizeof(mask), &mask);
      tids[i] = static_cast<int64_t>(syscall(SYS_gettid));
    }
  }
  for (int i = 0; i < n; ++i) {
    if (errors[i] != 0 || tids[i] < 0) {
      throw std::runtime_error("pin_omp_threads: could not bind a thread to CPU " +
                               std::to_string(cpu_ids[i]));
    }
  }
  return tids;
}
