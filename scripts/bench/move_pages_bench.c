/*
 * The C baseline for scripts/bench/vm_migrate.py: move another process's
 * pages to one NUMA node with move_pages(2), the way a hand-written C tool
 * would, and time it.
 *
 *   move_pages_bench PID ADDR LEN NODE [BATCH_PAGES]
 *
 * Builds the page-address array for [ADDR, ADDR+LEN), calls move_pages in
 * batches of BATCH_PAGES (default 65536, the migrator's batch) and prints
 *
 *   pages=N on_node=M busy=B seconds=S
 *
 * where S covers building the arrays and the syscalls (not process start-up),
 * and on_node counts pages whose status is NODE afterwards. Exit 1 on a
 * failed call. Build: gcc -O2 -o move_pages_bench move_pages_bench.c -lnuma
 */
#define _GNU_SOURCE
#include <errno.h>
#include <numaif.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static double now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

int main(int argc, char **argv)
{
	if (argc < 5) {
		fprintf(stderr, "usage: %s PID ADDR LEN NODE [BATCH_PAGES]\n", argv[0]);
		return 2;
	}
	int pid = atoi(argv[1]);
	unsigned long addr = strtoul(argv[2], NULL, 0);
	unsigned long len = strtoul(argv[3], NULL, 0);
	int node = atoi(argv[4]);
	unsigned long batch = argc > 5 ? strtoul(argv[5], NULL, 0) : 65536;
	long page = sysconf(_SC_PAGESIZE);
	unsigned long n = len / page;

	double t0 = now();
	void **pages = malloc(n * sizeof(*pages));
	int *nodes = malloc(n * sizeof(*nodes));
	int *status = malloc(n * sizeof(*status));
	if (!pages || !nodes || !status) {
		perror("malloc");
		return 1;
	}
	for (unsigned long i = 0; i < n; i++) {
		pages[i] = (void *)(addr + i * page);
		nodes[i] = node;
	}
	for (unsigned long i = 0; i < n; i += batch) {
		unsigned long m = n - i < batch ? n - i : batch;
		if (move_pages(pid, m, pages + i, nodes + i, status + i, MPOL_MF_MOVE) < 0) {
			fprintf(stderr, "move_pages(pid=%d, %lu pages, node %d): %s\n", pid, m, node,
				strerror(errno));
			return 1;
		}
	}
	double secs = now() - t0;

	unsigned long on_node = 0, busy = 0;
	for (unsigned long i = 0; i < n; i++) {
		on_node += status[i] == node;
		busy += status[i] == -EBUSY;
	}
	printf("pages=%lu on_node=%lu busy=%lu seconds=%.6f\n", n, on_node, busy, secs);
	return 0;
}
