/* The kernels' thread team (team.c): `fn(ctx, part, slot)` for part 0 .. parts - 1, on the calling
   thread (slot 0) and up to threads - 1 helpers (slots 1 ..). Returns when every part is done. */
#ifndef DISAGG_TEAM_H
#define DISAGG_TEAM_H
#include <stdint.h>

/* parts per thread a kernel splits its work in: a late helper's share is taken by the others */
#define TEAM_PARTS 4

typedef void (*team_part)(void *ctx, int64_t part, int64_t slot);

void team_run(team_part fn, void *ctx, int64_t parts, int64_t threads);
int64_t team_helpers(void);

#endif
