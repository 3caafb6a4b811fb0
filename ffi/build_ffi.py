"""cffi build script: every C declaration kvtier uses lives here and only here.

API mode: the extension is compiled at install time against libnuma's headers
and the kernel UAPI headers, so struct layouts and constants come from the
real headers, not from hand-copied numbers. Raw syscalls that glibc does not
wrap (move_pages without libnuma's checks, process_madvise, pidfd_open,
perf_event_open) get thin C wrappers; each returns -1 and sets errno like
libc so the Python side has one error path.

Built as ``kvtier._native``. Optional kernel features are exposed as
``KVT_HAS_*`` constants (1 when the headers define the syscall number); the
running kernel may still answer ENOSYS, which the Python wrappers turn into
FeatureUnavailable.
"""

from cffi import FFI

CDEF = r"""
/* ---- libnuma ---------------------------------------------------------- */
struct bitmask { unsigned long size; unsigned long *maskp; };
int numa_available(void);
int numa_max_node(void);
int numa_num_configured_nodes(void);
long long numa_node_size64(int node, long long *freep);
int numa_distance(int node1, int node2);
int numa_move_pages(int pid, unsigned long count, void **pages,
                    const int *nodes, int *status, int flags);
int numa_migrate_pages(int pid, struct bitmask *fromnodes,
                       struct bitmask *tonodes);
struct bitmask *numa_allocate_nodemask(void);
void numa_bitmask_free(struct bitmask *bmp);
struct bitmask *numa_bitmask_setbit(struct bitmask *bmp, unsigned int n);

/* ---- libc / syscalls -------------------------------------------------- */
struct iovec { void *iov_base; size_t iov_len; };
typedef int... pid_t;
typedef long... ssize_t;

ssize_t process_vm_readv(pid_t pid, const struct iovec *local_iov,
                         unsigned long liovcnt,
                         const struct iovec *remote_iov,
                         unsigned long riovcnt, unsigned long flags);

long kvt_move_pages(int pid, unsigned long count, void **pages,
                    const int *nodes, int *status, int flags);
long kvt_migrate_pages(int pid, unsigned long maxnode,
                       const unsigned long *old_nodes,
                       const unsigned long *new_nodes);
long kvt_mbind(void *addr, unsigned long len, int mode,
               const unsigned long *nodemask, unsigned long maxnode,
               unsigned int flags);
int kvt_pidfd_open(int pid, unsigned int flags);
long kvt_process_madvise(int pidfd, const struct iovec *iov, size_t vlen,
                         int advice, unsigned int flags);
int kvt_perf_open(unsigned int type, unsigned long long config,
                  unsigned long long sample_period,
                  unsigned long long sample_type,
                  int precise_ip, int exclude_kernel,
                  int pid, int cpu, unsigned long flags);
int kvt_perf_attr_size(void);
/* io_uring fixed buffers: the one way to make a long-term (FOLL_LONGTERM)
   pin of ordinary memory without a GPU or an RDMA NIC. kvtier itself never
   pins; tests use it to check how pinned KV pools are detected. */
int kvt_io_uring_setup(unsigned int entries);
long kvt_io_uring_register_buffers(int ring_fd, const struct iovec *iov, unsigned int n);
long kvt_io_uring_unregister_buffers(int ring_fd);
long kvt_cachestat_ranges(int fd, const unsigned long long *offs,
                          const unsigned long long *lens, size_t n,
                          unsigned long long *cache,
                          unsigned long long *evicted);
unsigned long long kvt_map_ranges(int fd, const unsigned long long *offs,
                                  const unsigned long long *lens, size_t n,
                                  unsigned long long *addrs,
                                  unsigned long long *total);
int kvt_unmap(unsigned long long addr, unsigned long long len);

/* ---- constants --------------------------------------------------------- */
#define MPOL_MF_MOVE ...
#define MPOL_MF_MOVE_ALL ...
#define MPOL_DEFAULT ...
#define MPOL_PREFERRED ...
#define MPOL_BIND ...
#define MPOL_INTERLEAVE ...
#define MPOL_MF_STRICT ...
#define MADV_PAGEOUT ...
#define MADV_COLD ...
#define MADV_WILLNEED ...
#define PERF_TYPE_SOFTWARE ...
#define PERF_TYPE_HARDWARE ...
#define PERF_TYPE_RAW ...
#define PERF_COUNT_SW_PAGE_FAULTS_MAJ ...
#define PERF_COUNT_SW_PAGE_FAULTS ...
#define PERF_SAMPLE_IP ...
#define PERF_SAMPLE_TID ...
#define PERF_SAMPLE_ADDR ...
#define PERF_SAMPLE_TIME ...
#define PERF_FLAG_FD_CLOEXEC ...
#define IOV_MAX ...
static const int KVT_HAS_PROCESS_MADVISE;
static const int KVT_HAS_PIDFD_OPEN;
static const int KVT_HAS_PERF_EVENT_OPEN;
static const int KVT_HAS_MOVE_PAGES;
static const int KVT_HAS_IO_URING;
"""

SOURCE = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <numa.h>
#include <numaif.h>
#include <linux/perf_event.h>
#include <linux/io_uring.h>

#ifndef MADV_PAGEOUT
#define MADV_PAGEOUT 21
#endif
#ifndef MADV_COLD
#define MADV_COLD 20
#endif
#ifndef IOV_MAX
#define IOV_MAX 1024
#endif

#ifdef SYS_process_madvise
static const int KVT_HAS_PROCESS_MADVISE = 1;
#else
static const int KVT_HAS_PROCESS_MADVISE = 0;
#endif
#ifdef SYS_pidfd_open
static const int KVT_HAS_PIDFD_OPEN = 1;
#else
static const int KVT_HAS_PIDFD_OPEN = 0;
#endif
#ifdef SYS_perf_event_open
static const int KVT_HAS_PERF_EVENT_OPEN = 1;
#else
static const int KVT_HAS_PERF_EVENT_OPEN = 0;
#endif
#ifdef SYS_move_pages
static const int KVT_HAS_MOVE_PAGES = 1;
#else
static const int KVT_HAS_MOVE_PAGES = 0;
#endif

#if defined(SYS_io_uring_setup) && defined(SYS_io_uring_register)
static const int KVT_HAS_IO_URING = 1;
#else
static const int KVT_HAS_IO_URING = 0;
#endif

static long kvt_enosys(void) { errno = ENOSYS; return -1; }

long kvt_move_pages(int pid, unsigned long count, void **pages,
                    const int *nodes, int *status, int flags)
{
#ifdef SYS_move_pages
    return syscall(SYS_move_pages, pid, count, pages, nodes, status, flags);
#else
    return kvt_enosys();
#endif
}

long kvt_migrate_pages(int pid, unsigned long maxnode,
                       const unsigned long *old_nodes,
                       const unsigned long *new_nodes)
{
    return syscall(SYS_migrate_pages, pid, maxnode, old_nodes, new_nodes);
}

long kvt_mbind(void *addr, unsigned long len, int mode,
               const unsigned long *nodemask, unsigned long maxnode,
               unsigned int flags)
{
    return syscall(SYS_mbind, addr, len, mode, nodemask, maxnode, flags);
}

int kvt_pidfd_open(int pid, unsigned int flags)
{
#ifdef SYS_pidfd_open
    return (int)syscall(SYS_pidfd_open, pid, flags);
#else
    return (int)kvt_enosys();
#endif
}

long kvt_process_madvise(int pidfd, const struct iovec *iov, size_t vlen,
                         int advice, unsigned int flags)
{
#ifdef SYS_process_madvise
    return syscall(SYS_process_madvise, pidfd, iov, vlen, advice, flags);
#else
    return kvt_enosys();
#endif
}

int kvt_perf_open(unsigned int type, unsigned long long config,
                  unsigned long long sample_period,
                  unsigned long long sample_type,
                  int precise_ip, int exclude_kernel,
                  int pid, int cpu, unsigned long flags)
{
#ifdef SYS_perf_event_open
    struct perf_event_attr attr;
    memset(&attr, 0, sizeof(attr));
    attr.size = sizeof(attr);
    attr.type = type;
    attr.config = config;
    attr.sample_period = sample_period;
    attr.sample_type = sample_type;
    attr.precise_ip = precise_ip;
    attr.exclude_kernel = exclude_kernel ? 1 : 0;
    attr.exclude_hv = 1;
    attr.disabled = 1;
    attr.wakeup_events = 1;
    return (int)syscall(SYS_perf_event_open, &attr, pid, cpu, -1, flags);
#else
    return (int)kvt_enosys();
#endif
}

int kvt_perf_attr_size(void) { return (int)sizeof(struct perf_event_attr); }

int kvt_io_uring_setup(unsigned int entries)
{
#if defined(SYS_io_uring_setup) && defined(SYS_io_uring_register)
    struct io_uring_params p;
    memset(&p, 0, sizeof(p));
    /* The rings are never mmapped: only the registration is used. */
    return (int)syscall(SYS_io_uring_setup, entries, &p);
#else
    return (int)kvt_enosys();
#endif
}

long kvt_io_uring_register_buffers(int ring_fd, const struct iovec *iov, unsigned int n)
{
#if defined(SYS_io_uring_setup) && defined(SYS_io_uring_register)
    return syscall(SYS_io_uring_register, ring_fd, IORING_REGISTER_BUFFERS, iov, n);
#else
    return kvt_enosys();
#endif
}

long kvt_io_uring_unregister_buffers(int ring_fd)
{
#if defined(SYS_io_uring_setup) && defined(SYS_io_uring_register)
    return syscall(SYS_io_uring_register, ring_fd, IORING_UNREGISTER_BUFFERS, NULL, 0);
#else
    return kvt_enosys();
#endif
}

/* cachestat(2), Linux 6.5+. The number is the same on every architecture
 * kvtier builds for (new syscalls share one table since 5.1); glibc and the
 * bookworm UAPI headers do not know it yet. */
#ifndef __NR_cachestat
#define __NR_cachestat 451
#endif
struct kvt_cachestat_range { unsigned long long off, len; };
struct kvt_cachestat {
    unsigned long long nr_cache, nr_dirty, nr_writeback, nr_evicted, nr_recently_evicted;
};

/* Page-cache and evicted pages of each of n file ranges: one cachestat per
 * range, in one call without the GIL. For shmem, nr_evicted counts the
 * pages whose entry is a swap entry (also while the page still sits in the
 * swap cache), nr_cache the pages in its page cache. Stops at the first
 * failure: -1 with errno (ENOSYS: kernel before 6.5; EPERM: a seccomp
 * filter that does not know the call). */
long kvt_cachestat_ranges(int fd, const unsigned long long *offs,
                          const unsigned long long *lens, size_t n,
                          unsigned long long *cache,
                          unsigned long long *evicted)
{
    for (size_t i = 0; i < n; i++) {
        struct kvt_cachestat_range r = { offs[i], lens[i] };
        struct kvt_cachestat cs;
        if (syscall(__NR_cachestat, fd, &r, &cs, 0) < 0)
            return -1;
        cache[i] = cs.nr_cache;
        evicted[i] = cs.nr_evicted;
    }
    return 0;
}

/* Map n ranges of a file read-only and shared, never touched, each as a VMA
 * of its own: a PROT_NONE page between neighbours keeps the kernel from
 * merging them, so /proc/self/smaps reports each range's Swap (for shmem the
 * swap entries of exactly that range). Returns the base of the reservation
 * (0 and errno on failure), each range's address in addrs, the length to
 * unmap in *total. */
unsigned long long kvt_map_ranges(int fd, const unsigned long long *offs,
                                  const unsigned long long *lens, size_t n,
                                  unsigned long long *addrs,
                                  unsigned long long *total)
{
    unsigned long long ps = (unsigned long long)sysconf(_SC_PAGESIZE);
    unsigned long long len = ps;
    for (size_t i = 0; i < n; i++)
        len += lens[i] + ps;
    char *base = mmap(NULL, len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (base == MAP_FAILED)
        return 0;
    char *pos = base + ps;
    for (size_t i = 0; i < n; i++) {
        if (mmap(pos, lens[i], PROT_READ, MAP_SHARED | MAP_FIXED, fd, (off_t)offs[i]) == MAP_FAILED) {
            int saved = errno;
            munmap(base, len);
            errno = saved;
            return 0;
        }
        addrs[i] = (unsigned long long)(uintptr_t)pos;
        pos += lens[i] + ps;
    }
    *total = len;
    return (unsigned long long)(uintptr_t)base;
}

int kvt_unmap(unsigned long long addr, unsigned long long len)
{
    return munmap((void *)(uintptr_t)addr, len);
}
"""

ffibuilder = FFI()
ffibuilder.cdef(CDEF)
ffibuilder.set_source("kvtier._native", SOURCE, libraries=["numa"])

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
