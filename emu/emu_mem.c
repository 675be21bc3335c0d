/*
 * Emulated device memory. A physical allocation is a sealed memfd with one
 * metadata page after the data, so that an importer in another process learns
 * its size and device from the fd alone. Reservations are PROT_NONE anonymous
 * ranges; mapping puts the memfd over part of one, and access rights become
 * mprotect. Device pointers are therefore real addresses of this process and
 * a mapped allocation is really shared between processes.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "emu.h"
#include "emu_internal.h"

#define META_MAGIC   0x31544d45544d4d56ULL /* "VMMTEMT1" */
#define FABRIC_MAGIC 0x31424146544d4d56ULL /* "VMMTFAB1" */
#define HANDLE_TAG   0x5e00000000000000ULL
#define PAGE         4096

/* At the end of every memfd, after the data. */
struct emu_meta {
    uint64_t magic;
    uint64_t size;
    uint64_t cookie;
    int32_t device; /* the device, or the NUMA node of a host allocation */
    uint32_t types;
    uint32_t location; /* CU_MEM_LOCATION_TYPE_DEVICE or _HOST_NUMA */
    uint32_t unused;
};

/* The content of a CUmemFabricHandle: where the exporter keeps the memfd. */
struct emu_fabric {
    uint64_t magic;
    uint64_t cookie;
    uint64_t ino;
    uint64_t dev;
    uint64_t size;
    int32_t pid;
    int32_t fd;
};
_Static_assert(sizeof(struct emu_fabric) <= sizeof(CUmemFabricHandle), "fabric handle size");

struct emu_alloc {
    struct emu_alloc *next;
    uint64_t handle; /* 0 once cuMemRelease dropped it */
    int fd;
    size_t size;
    int device;
    unsigned types;
    uint64_t cookie;
    int imported; /* from cuMemImportFromShareableHandle: not counted as ours */
    int host;  /* host-NUMA memory: no device's memory is charged, the CPU may be granted access */
    int holds; /* the handle, plus one per mapping */
    int retains; /* cuMemRetainAllocationHandle calls not yet released */
    dev_t st_dev;
    ino_t st_ino;
};

struct emu_resv {
    struct emu_resv *next;
    uintptr_t base;
    size_t size;
};

struct emu_map {
    struct emu_map *next;
    uintptr_t addr;
    size_t size;
    struct emu_alloc *alloc;
    uint64_t read_mask; /* devices allowed to read, one bit each */
    uint64_t write_mask;
    int host_prot; /* PROT_* the CPU was granted (host-NUMA allocations only) */
};

/*
 * cuMemAlloc (device >= 0) and cuMemAllocHost (device -1) blocks, and host
 * memory of the application's registered with cuMemHostRegister (device -1,
 * registered: the emulator neither mapped it nor unmaps it).
 */
struct emu_block {
    struct emu_block *next;
    uintptr_t addr;
    size_t size;   /* as asked */
    size_t mapped; /* rounded up to pages */
    int device;
    int registered;
};

static pthread_rwlock_t g_mem_rw = PTHREAD_RWLOCK_WRITER_NONRECURSIVE_INITIALIZER_NP;
static struct emu_alloc *g_allocs;
static struct emu_resv *g_resvs;
static struct emu_map *g_maps;
static struct emu_block *g_blocks;
static int g_n_allocs, g_n_resvs, g_n_maps, g_n_blocks;
static unsigned long long g_used[EMU_MAX_DEVICES]; /* bytes created per device */
static unsigned long long g_host_used;             /* bytes of host-NUMA allocations created */
static uint64_t g_handle_seq;

void vmmt__emu_mem_read_lock(void)
{
    pthread_rwlock_rdlock(&g_mem_rw);
}
void vmmt__emu_mem_read_unlock(void)
{
    pthread_rwlock_unlock(&g_mem_rw);
}

/* Take or drop both locks, in the documented order, for changes that remove access. */
static void write_lock(void)
{
    pthread_rwlock_wrlock(&g_mem_rw);
    vmmt__emu_lock();
}

static void write_unlock(void)
{
    vmmt__emu_unlock();
    pthread_rwlock_unlock(&g_mem_rw);
}

static int locked_get(int *counter)
{
    int n;

    vmmt__emu_lock();
    n = *counter;
    vmmt__emu_unlock();
    return n;
}

int vmmt__emu_live_allocations(void)
{
    return locked_get(&g_n_allocs);
}
int vmmt__emu_live_reservations(void)
{
    return locked_get(&g_n_resvs);
}
int vmmt__emu_live_mappings(void)
{
    return locked_get(&g_n_maps);
}
int vmmt__emu_live_blocks(void)
{
    return locked_get(&g_n_blocks);
}

unsigned long long vmmt__emu_device_bytes(void)
{
    unsigned long long n = 0;

    vmmt__emu_lock();
    for (int i = 0; i < EMU_MAX_DEVICES; i++)
        n += g_used[i];
    vmmt__emu_unlock();
    return n;
}

unsigned long long vmmt__emu_reserved_bytes(void)
{
    unsigned long long n = 0;

    vmmt__emu_lock();
    for (const struct emu_resv *rv = g_resvs; rv != NULL; rv = rv->next)
        n += rv->size;
    vmmt__emu_unlock();
    return n;
}

unsigned long long vmmt__emu_host_numa_bytes(void)
{
    unsigned long long n;

    vmmt__emu_lock();
    n = g_host_used;
    vmmt__emu_unlock();
    return n;
}

/* ------------------------------------------------------------- accounting */

/* Count size against dev's memory if it fits; mutex held. */
static CUresult charge(int dev, size_t size)
{
    unsigned long long total = vmmt__emu_cfg()->total_mem;

    if (size > total || g_used[dev] > total - size) return CUDA_ERROR_OUT_OF_MEMORY;
    g_used[dev] += size;
    return CUDA_SUCCESS;
}

static void refund(int dev, size_t size)
{
    vmmt__emu_lock();
    g_used[dev] -= size;
    vmmt__emu_unlock();
}

/* ---------------------------------------------------------- allocations */

static struct emu_alloc *find_handle(CUmemGenericAllocationHandle h)
{
    for (struct emu_alloc *a = g_allocs; a != NULL; a = a->next)
        if (h != 0 && a->handle == h) return a;
    return NULL;
}

/* Publish a new allocation under a fresh, never reused handle; mutex held. */
static CUmemGenericAllocationHandle publish(struct emu_alloc *a)
{
    a->handle = HANDLE_TAG | ++g_handle_seq;
    a->holds = 1;
    a->next = g_allocs;
    g_allocs = a;
    g_n_allocs++;
    return a->handle;
}

/* Drop one hold; the last one frees the memory. Mutex held. */
static void drop_hold(struct emu_alloc *a)
{
    if (--a->holds > 0) return;
    for (struct emu_alloc **pp = &g_allocs; *pp != NULL; pp = &(*pp)->next)
        if (*pp == a) {
            *pp = a->next;
            break;
        }
    g_n_allocs--;
    if (!a->imported && a->host) g_host_used -= a->size;
    if (!a->imported && !a->host) g_used[a->device] -= a->size;
    close(a->fd);
    free(a);
}

static uint64_t random_cookie(void)
{
    uint64_t c = 0;
    struct timespec ts;

    if (getrandom(&c, sizeof c, GRND_NONBLOCK) == (ssize_t)sizeof c && c != 0) return c;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ((uint64_t)ts.tv_nsec << 32) ^ (uint64_t)ts.tv_sec ^ ((uint64_t)getpid() << 16) ^ 1;
}

/* A sealed memfd of size bytes plus the metadata page; -1 on failure. */
static int new_memfd(size_t size, const struct emu_meta *meta)
{
    int fd = memfd_create("vmmt-emu", MFD_CLOEXEC | MFD_ALLOW_SEALING);

    if (fd < 0) goto fail;
    if (ftruncate(fd, (off_t)(size + EMU_META_SIZE)) != 0) goto fail_fd;
    if (pwrite(fd, meta, sizeof *meta, (off_t)size) != (ssize_t)sizeof *meta) goto fail_fd;
    /* Nobody, importers included, may resize it: a mapped page past the end is SIGBUS. */
    if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) goto fail_fd;
    return fd;
fail_fd:
    close(fd);
fail:
    return -1;
}

/*
 * Device memory, or host memory on a NUMA node (which needs no context, as
 * on the H200). A plain HOST location with POSIX_FD is refused there with
 * CUDA_ERROR_INVALID_VALUE, and here with it.
 */
static CUresult check_prop(const CUmemAllocationProp *prop)
{
    if (prop == NULL || prop->type != CU_MEM_ALLOCATION_TYPE_PINNED)
        return CUDA_ERROR_INVALID_VALUE;
    if (prop->location.type == CU_MEM_LOCATION_TYPE_HOST_NUMA)
        return prop->location.id >= 0 && prop->location.id < EMU_NUMA_NODES
                   ? CUDA_SUCCESS
                   : CUDA_ERROR_INVALID_VALUE;
    if (prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE) return CUDA_ERROR_INVALID_VALUE;
    if (!vmmt__emu_device_ok(prop->location.id)) return CUDA_ERROR_INVALID_DEVICE;
    return CUDA_SUCCESS;
}

CUresult vmmt__emu_cuMemGetAllocationGranularity(size_t *granularity,
                                                 const CUmemAllocationProp *prop,
                                                 CUmemAllocationGranularity_flags option)
{
    CUresult r;

    EMU_ENTER(cuMemGetAllocationGranularity, 1);
    if (granularity == NULL || (option != CU_MEM_ALLOC_GRANULARITY_MINIMUM &&
                                option != CU_MEM_ALLOC_GRANULARITY_RECOMMENDED))
        return CUDA_ERROR_INVALID_VALUE;
    if ((r = check_prop(prop)) != CUDA_SUCCESS) return r;
    vmmt__emu_lock();
    *granularity = vmmt__emu_cfg()->granularity;
    vmmt__emu_unlock();
    return CUDA_SUCCESS;
}

/* Size, handle types and memory of a cuMemCreate; charges the device. Mutex held. */
static CUresult admit_create(size_t size, unsigned types, int dev, int host)
{
    const struct emu_cfg *cfg = vmmt__emu_cfg();
    const unsigned known = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR | CU_MEM_HANDLE_TYPE_FABRIC;

    if (size == 0 || size % cfg->granularity != 0) return CUDA_ERROR_INVALID_VALUE;
    if ((types & ~known) != 0) return CUDA_ERROR_NOT_SUPPORTED;
    /* As on a node without an IMEX channel: the attribute says yes, creation says no. */
    if ((types & CU_MEM_HANDLE_TYPE_FABRIC) && !(cfg->handles & CU_MEM_HANDLE_TYPE_FABRIC))
        return CUDA_ERROR_NOT_PERMITTED;
    if ((types & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) &&
        !(cfg->handles & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
        return CUDA_ERROR_NOT_SUPPORTED;
    if (host) {
        g_host_used += size;
        return CUDA_SUCCESS;
    }
    return charge(dev, size);
}

CUresult vmmt__emu_cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                               const CUmemAllocationProp *prop, unsigned long long flags)
{
    struct emu_meta meta = {META_MAGIC, 0, 0, 0, 0, CU_MEM_LOCATION_TYPE_DEVICE, 0};
    struct emu_alloc *a;
    struct stat st;
    CUresult r;
    int host;

    EMU_ENTER(cuMemCreate, 1);
    if (handle == NULL || flags != 0) return CUDA_ERROR_INVALID_VALUE;
    if ((r = check_prop(prop)) != CUDA_SUCCESS) return r;
    host = prop->location.type == CU_MEM_LOCATION_TYPE_HOST_NUMA;
    vmmt__emu_lock();
    r = admit_create(size, prop->requestedHandleTypes, prop->location.id, host);
    vmmt__emu_unlock();
    if (r != CUDA_SUCCESS) return r;

    meta.size = size;
    meta.cookie = random_cookie();
    meta.device = prop->location.id;
    meta.types = prop->requestedHandleTypes;
    meta.location = (uint32_t)prop->location.type;
    a = calloc(1, sizeof *a);
    if (a == NULL) goto fail_charge;
    a->fd = new_memfd(size, &meta);
    if (a->fd < 0 || fstat(a->fd, &st) != 0) goto fail_alloc;
    a->size = size;
    a->device = meta.device;
    a->types = meta.types;
    a->cookie = meta.cookie;
    a->host = host;
    a->st_dev = st.st_dev;
    a->st_ino = st.st_ino;
    vmmt__emu_lock();
    *handle = publish(a);
    vmmt__emu_unlock();
    return CUDA_SUCCESS;

fail_alloc:
    if (a->fd >= 0) close(a->fd);
    free(a);
fail_charge:
    if (host) {
        vmmt__emu_lock();
        g_host_used -= size;
        vmmt__emu_unlock();
    } else {
        refund(prop->location.id, size);
    }
    return CUDA_ERROR_OUT_OF_MEMORY;
}

CUresult vmmt__emu_cuMemRelease(CUmemGenericAllocationHandle handle)
{
    struct emu_alloc *a;

    EMU_ENTER(cuMemRelease, 1);
    vmmt__emu_lock();
    a = find_handle(handle);
    if (a != NULL) {
        /* Mappings keep the memory: releasing a mapped handle is legal. */
        if (a->retains > 0)
            a->retains--; /* the handle stays valid for its other owners */
        else
            a->handle = 0;
        drop_hold(a);
    }
    vmmt__emu_unlock();
    return a != NULL ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* ------------------------------------------------------- export, import */

static void fabric_handle(const struct emu_alloc *a, void *out)
{
    struct emu_fabric f;
    CUmemFabricHandle h;

    memset(&f, 0, sizeof f);
    memset(&h, 0, sizeof h);
    f.magic = FABRIC_MAGIC;
    f.cookie = a->cookie;
    f.ino = (uint64_t)a->st_ino;
    f.dev = (uint64_t)a->st_dev;
    f.size = a->size;
    f.pid = (int32_t)getpid();
    f.fd = a->fd;
    memcpy(h.data, &f, sizeof f);
    memcpy(out, &h, sizeof h);
}

CUresult vmmt__emu_cuMemExportToShareableHandle(void *out, CUmemGenericAllocationHandle handle,
                                                CUmemAllocationHandleType type,
                                                unsigned long long flags)
{
    struct emu_alloc *a;
    CUresult r = CUDA_SUCCESS;

    EMU_ENTER(cuMemExportToShareableHandle, 1);
    if (out == NULL || flags != 0) return CUDA_ERROR_INVALID_VALUE;
    vmmt__emu_lock();
    a = find_handle(handle);
    if (a == NULL ||
        (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR && type != CU_MEM_HANDLE_TYPE_FABRIC) ||
        (a->types & (unsigned)type) == 0) {
        r = CUDA_ERROR_INVALID_VALUE;
    } else if (type == CU_MEM_HANDLE_TYPE_FABRIC) {
        fabric_handle(a, out);
    } else {
        int fd = fcntl(a->fd, F_DUPFD_CLOEXEC, 0);
        if (fd < 0)
            r = CUDA_ERROR_OPERATING_SYSTEM;
        else
            *(int *)out = fd;
    }
    vmmt__emu_unlock();
    return r;
}

/*
 * Whether fd is an emulator allocation (sealed memfd with our metadata) and,
 * when cookie is non-zero, the one a fabric handle names. Fills meta.
 */
static CUresult read_meta(int fd, uint64_t cookie, struct emu_meta *meta)
{
    const int seals = F_SEAL_SHRINK | F_SEAL_GROW;
    struct stat st;

    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size <= EMU_META_SIZE)
        return CUDA_ERROR_INVALID_VALUE;
    if ((fcntl(fd, F_GET_SEALS) & seals) != seals) return CUDA_ERROR_INVALID_VALUE;
    if (pread(fd, meta, sizeof *meta, st.st_size - EMU_META_SIZE) != (ssize_t)sizeof *meta)
        return CUDA_ERROR_INVALID_VALUE;
    if (meta->magic != META_MAGIC || meta->size != (uint64_t)(st.st_size - EMU_META_SIZE))
        return CUDA_ERROR_INVALID_VALUE;
    if (cookie != 0 && meta->cookie != cookie) return CUDA_ERROR_INVALID_VALUE;
    if (meta->device < 0 || meta->device >= EMU_MAX_DEVICES) return CUDA_ERROR_INVALID_VALUE;
    if (meta->location != CU_MEM_LOCATION_TYPE_DEVICE &&
        meta->location != CU_MEM_LOCATION_TYPE_HOST_NUMA)
        return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}

/* Open the exporter's memfd through /proc; -1 unless it is the one the handle names. */
static int open_fabric(const void *os_handle, uint64_t *cookie)
{
    struct emu_fabric f;
    struct stat st;
    char path[64];
    int fd;

    memcpy(&f, os_handle, sizeof f);
    if (f.magic != FABRIC_MAGIC || f.pid <= 0 || f.fd < 0 || f.cookie == 0) return -1;
    snprintf(path, sizeof path, "/proc/%d/fd/%d", (int)f.pid, (int)f.fd);
    fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) return -1;
    /* The number may have been reused for another file since the export. */
    if (fstat(fd, &st) != 0 || (uint64_t)st.st_ino != f.ino || (uint64_t)st.st_dev != f.dev) {
        close(fd);
        return -1;
    }
    *cookie = f.cookie;
    return fd;
}

/* A private fd for the allocation os_handle names, or the reason it has none. */
static CUresult open_shared(void *os_handle, CUmemAllocationHandleType type, int *fd,
                            uint64_t *cookie)
{
    unsigned handles;

    vmmt__emu_lock();
    handles = vmmt__emu_cfg()->handles;
    vmmt__emu_unlock();
    *cookie = 0;
    if (type == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) {
        int theirs = (int)(intptr_t)os_handle;
        if (!(handles & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)) return CUDA_ERROR_NOT_SUPPORTED;
        *fd = theirs < 0 ? -1 : fcntl(theirs, F_DUPFD_CLOEXEC, 0);
    } else if (type == CU_MEM_HANDLE_TYPE_FABRIC) {
        if (!(handles & CU_MEM_HANDLE_TYPE_FABRIC)) return CUDA_ERROR_NOT_PERMITTED;
        *fd = os_handle == NULL ? -1 : open_fabric(os_handle, cookie);
    } else {
        return CUDA_ERROR_INVALID_VALUE;
    }
    return *fd < 0 ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}

CUresult vmmt__emu_cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle,
                                                  void *os_handle, CUmemAllocationHandleType type)
{
    struct emu_meta meta;
    struct emu_alloc *a;
    struct stat st;
    uint64_t cookie;
    CUresult r;
    int fd;

    EMU_ENTER(cuMemImportFromShareableHandle, 1);
    if (handle == NULL) return CUDA_ERROR_INVALID_VALUE;
    if ((r = open_shared(os_handle, type, &fd, &cookie)) != CUDA_SUCCESS) return r;
    if ((r = read_meta(fd, cookie, &meta)) != CUDA_SUCCESS) goto fail_fd;
    r = CUDA_ERROR_OUT_OF_MEMORY;
    if (fstat(fd, &st) != 0 || (a = calloc(1, sizeof *a)) == NULL) goto fail_fd;
    a->fd = fd;
    a->size = (size_t)meta.size;
    a->device = meta.device;
    a->types = meta.types;
    a->cookie = meta.cookie;
    a->host = meta.location == CU_MEM_LOCATION_TYPE_HOST_NUMA;
    a->imported = 1;
    a->st_dev = st.st_dev;
    a->st_ino = st.st_ino;
    vmmt__emu_lock();
    *handle = publish(a);
    vmmt__emu_unlock();
    return CUDA_SUCCESS;

fail_fd:
    close(fd);
    return r;
}

/* --------------------------------------------------------- reservations */

static void *trim_to_alignment(void *raw, size_t size, size_t align)
{
    uintptr_t start = (uintptr_t)raw, base = (start + align - 1) & ~(uintptr_t)(align - 1);
    uintptr_t end = start + size + align;

    if (base > start) munmap(raw, base - start);
    if (end > base + size) munmap((void *)(base + size), end - (base + size));
    return (void *)base;
}

CUresult vmmt__emu_cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment,
                                       CUdeviceptr addr, unsigned long long flags)
{
    const int mflags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;
    struct emu_resv *rv;
    size_t g, align;
    void *raw;

    EMU_ENTER(cuMemAddressReserve, 1);
    vmmt__emu_lock();
    g = vmmt__emu_cfg()->granularity;
    vmmt__emu_unlock();
    if (ptr == NULL || flags != 0 || size == 0 || size % g != 0) return CUDA_ERROR_INVALID_VALUE;
    if ((alignment & (alignment - 1)) != 0) return CUDA_ERROR_INVALID_VALUE;
    align = alignment > g ? alignment : g;
    if (size > SIZE_MAX - align) return CUDA_ERROR_OUT_OF_MEMORY;
    rv = calloc(1, sizeof *rv);
    if (rv == NULL) return CUDA_ERROR_OUT_OF_MEMORY;
    /* Over-reserve, then give back the head and tail that break the alignment. */
    raw = mmap((void *)(uintptr_t)addr, size + align, PROT_NONE, mflags, -1, 0);
    if (raw == MAP_FAILED) {
        free(rv);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    rv->base = (uintptr_t)trim_to_alignment(raw, size, align);
    rv->size = size;
    vmmt__emu_lock();
    rv->next = g_resvs;
    g_resvs = rv;
    g_n_resvs++;
    vmmt__emu_unlock();
    *ptr = rv->base;
    return CUDA_SUCCESS;
}

static int any_mapping_in(uintptr_t base, size_t size)
{
    for (struct emu_map *m = g_maps; m != NULL; m = m->next)
        if (m->addr < base + size && base < m->addr + m->size) return 1;
    return 0;
}

CUresult vmmt__emu_cuMemAddressFree(CUdeviceptr ptr, size_t size)
{
    struct emu_resv **pp, *rv = NULL;

    EMU_ENTER(cuMemAddressFree, 1);
    vmmt__emu_lock();
    for (pp = &g_resvs; *pp != NULL; pp = &(*pp)->next)
        if ((*pp)->base == ptr && (*pp)->size == size) break;
    if (*pp != NULL && !any_mapping_in(ptr, size)) {
        rv = *pp;
        *pp = rv->next;
        g_n_resvs--;
        munmap((void *)rv->base, rv->size);
    }
    vmmt__emu_unlock();
    free(rv);
    return rv != NULL ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* ------------------------------------------------------------- mappings */

static struct emu_resv *resv_holding(uintptr_t p, size_t n)
{
    for (struct emu_resv *rv = g_resvs; rv != NULL; rv = rv->next)
        if (p >= rv->base && n <= rv->size && p - rv->base <= rv->size - n) return rv;
    return NULL;
}

/* Why h cannot be mapped at [ptr, ptr+size) from offset; mutex held. */
static CUresult check_map(CUdeviceptr ptr, size_t size, size_t offset, struct emu_alloc *a)
{
    size_t g = vmmt__emu_cfg()->granularity;

    if (a == NULL || size == 0) return CUDA_ERROR_INVALID_VALUE;
    if (ptr % g != 0 || size % g != 0 || offset % g != 0) return CUDA_ERROR_INVALID_VALUE;
    if (offset > a->size || size > a->size - offset) return CUDA_ERROR_INVALID_VALUE;
    if (resv_holding(ptr, size) == NULL) return CUDA_ERROR_INVALID_VALUE;
    if (any_mapping_in(ptr, size)) return CUDA_ERROR_ALREADY_MAPPED;
    return CUDA_SUCCESS;
}

/* Put the reservation's PROT_NONE anonymous pages back over [p, p+n). */
static void restore_reserved(uintptr_t p, size_t n)
{
    const int mflags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED;

    if (mmap((void *)p, n, PROT_NONE, mflags, -1, 0) == MAP_FAILED)
        fprintf(stderr, "vmmt emu: cannot restore reserved range %#lx+%zu: %s\n", (unsigned long)p,
                n, strerror(errno));
}

CUresult vmmt__emu_cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
                            CUmemGenericAllocationHandle handle, unsigned long long flags)
{
    struct emu_alloc *a;
    struct emu_map *m;
    CUresult r;

    EMU_ENTER(cuMemMap, 1);
    if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
    if ((m = calloc(1, sizeof *m)) == NULL) return CUDA_ERROR_OUT_OF_MEMORY;
    vmmt__emu_lock();
    a = find_handle(handle);
    if ((r = check_map(ptr, size, offset, a)) != CUDA_SUCCESS) goto fail;
    /* No access until cuMemSetAccess, as on the device. */
    if (mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, a->fd,
             (off_t)offset) == MAP_FAILED) {
        restore_reserved(ptr, size);
        r = CUDA_ERROR_OUT_OF_MEMORY;
        goto fail;
    }
    m->addr = ptr;
    m->size = size;
    m->alloc = a;
    a->holds++;
    m->next = g_maps;
    g_maps = m;
    g_n_maps++;
    vmmt__emu_unlock();
    return CUDA_SUCCESS;

fail:
    vmmt__emu_unlock();
    free(m);
    return r;
}

static struct emu_map *map_at(uintptr_t addr)
{
    for (struct emu_map *m = g_maps; m != NULL; m = m->next)
        if (m->addr == addr) return m;
    return NULL;
}

static struct emu_map *map_containing(uintptr_t addr)
{
    for (struct emu_map *m = g_maps; m != NULL; m = m->next)
        if (addr >= m->addr && addr - m->addr < m->size) return m;
    return NULL;
}

/* Whether [p, p+n) is exactly a run of whole mappings; mutex held. */
static int whole_mappings(uintptr_t p, size_t n)
{
    uintptr_t cur = p, end = p + n;
    struct emu_map *m;

    if (n == 0 || end < p) return 0;
    while (cur < end) {
        if ((m = map_at(cur)) == NULL) return 0;
        cur += m->size;
    }
    return cur == end;
}

static void unlink_map(struct emu_map *m)
{
    for (struct emu_map **pp = &g_maps; *pp != NULL; pp = &(*pp)->next)
        if (*pp == m) {
            *pp = m->next;
            break;
        }
    g_n_maps--;
}

CUresult vmmt__emu_cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    uintptr_t cur = ptr;

    EMU_ENTER(cuMemUnmap, 1);
    write_lock();
    if (!whole_mappings(ptr, size)) {
        write_unlock();
        return CUDA_ERROR_INVALID_VALUE;
    }
    while (cur < ptr + size) {
        struct emu_map *m = map_at(cur);
        cur += m->size;
        restore_reserved(m->addr, m->size);
        unlink_map(m);
        drop_hold(m->alloc);
        free(m);
    }
    write_unlock();
    return CUDA_SUCCESS;
}

static CUresult check_access_descs(const CUmemAccessDesc *desc, size_t count)
{
    int devices;

    if (desc == NULL || count == 0) return CUDA_ERROR_INVALID_VALUE;
    vmmt__emu_lock();
    devices = vmmt__emu_cfg()->devices;
    vmmt__emu_unlock();
    for (size_t i = 0; i < count; i++) {
        int type = desc[i].location.type;
        if (type == CU_MEM_LOCATION_TYPE_HOST_NUMA &&
            (desc[i].location.id < 0 || desc[i].location.id >= EMU_NUMA_NODES))
            return CUDA_ERROR_INVALID_VALUE;
        if (type != CU_MEM_LOCATION_TYPE_DEVICE && type != CU_MEM_LOCATION_TYPE_HOST &&
            type != CU_MEM_LOCATION_TYPE_HOST_NUMA)
            return CUDA_ERROR_INVALID_VALUE;
        if (type == CU_MEM_LOCATION_TYPE_DEVICE &&
            (desc[i].location.id < 0 || desc[i].location.id >= devices))
            return CUDA_ERROR_INVALID_DEVICE;
        if (desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_NONE &&
            desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_READ &&
            desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
            return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}

/*
 * Record the devices' (and, for host-NUMA memory, the CPU's) rights on m and
 * make the host protection their union.
 */
static CUresult apply_access(struct emu_map *m, const CUmemAccessDesc *desc, size_t count)
{
    int prot = PROT_NONE;

    for (size_t i = 0; i < count; i++)
        if (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE && !m->alloc->host)
            return CUDA_ERROR_INVALID_VALUE; /* the CPU is never granted device memory */
    for (size_t i = 0; i < count; i++) {
        uint64_t bit;
        if (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE) {
            m->host_prot = desc[i].flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE
                               ? PROT_READ | PROT_WRITE
                           : desc[i].flags == CU_MEM_ACCESS_FLAGS_PROT_READ ? PROT_READ
                                                                            : PROT_NONE;
            continue;
        }
        bit = 1ULL << desc[i].location.id;
        m->read_mask &= ~bit;
        m->write_mask &= ~bit;
        if (desc[i].flags & CU_MEM_ACCESS_FLAGS_PROT_READ) m->read_mask |= bit;
        if (desc[i].flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE) m->write_mask |= bit;
    }
    if (m->read_mask != 0) prot = PROT_READ;
    if (m->write_mask != 0) prot = PROT_READ | PROT_WRITE;
    prot |= m->host_prot;
    return mprotect((void *)m->addr, m->size, prot) == 0 ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

CUresult vmmt__emu_cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc,
                                  size_t count)
{
    CUresult r;
    uintptr_t cur = ptr;

    EMU_ENTER(cuMemSetAccess, 1);
    if ((r = check_access_descs(desc, count)) != CUDA_SUCCESS) return r;
    write_lock();
    if (!whole_mappings(ptr, size)) r = CUDA_ERROR_INVALID_VALUE;
    while (r == CUDA_SUCCESS && cur < ptr + size) {
        struct emu_map *m = map_at(cur);
        cur += m->size;
        r = apply_access(m, desc, count);
    }
    write_unlock();
    return r;
}

/* ------------------------------------------------- cuMemAlloc, host blocks */

/* A new page-aligned read-write block of size bytes for device (-1: host). */
static CUresult add_block(size_t size, int device, uintptr_t *addr)
{
    struct emu_block *b = calloc(1, sizeof *b);
    void *p;

    if (b == NULL) return CUDA_ERROR_OUT_OF_MEMORY;
    b->mapped = (size + PAGE - 1) & ~(size_t)(PAGE - 1);
    p = mmap(NULL, b->mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
             -1, 0);
    if (p == MAP_FAILED) {
        free(b);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    b->addr = (uintptr_t)p;
    b->size = size;
    b->device = device;
    vmmt__emu_lock();
    b->next = g_blocks;
    g_blocks = b;
    g_n_blocks++;
    vmmt__emu_unlock();
    *addr = b->addr;
    return CUDA_SUCCESS;
}

/* Unlink and unmap the block at addr of the given kind; both locks held. */
static int remove_block(uintptr_t addr, int host, int registered)
{
    for (struct emu_block **pp = &g_blocks; *pp != NULL; pp = &(*pp)->next) {
        struct emu_block *b = *pp;
        if (b->addr != addr || (b->device < 0) != host || b->registered != registered) continue;
        *pp = b->next;
        g_n_blocks--;
        if (!host) g_used[b->device] -= b->size;
        if (!registered) munmap((void *)b->addr, b->mapped);
        free(b);
        return 1;
    }
    return 0;
}

CUresult vmmt__emu_cuMemAlloc(CUdeviceptr *dptr, size_t size)
{
    uintptr_t p;
    CUresult r;
    int dev;

    EMU_ENTER(cuMemAlloc, 1);
    if ((dev = vmmt__emu_current_device()) < 0) return CUDA_ERROR_INVALID_CONTEXT;
    if (dptr == NULL || size == 0) return CUDA_ERROR_INVALID_VALUE;
    vmmt__emu_lock();
    r = charge(dev, size);
    vmmt__emu_unlock();
    if (r != CUDA_SUCCESS) return r;
    if ((r = add_block(size, dev, &p)) != CUDA_SUCCESS) {
        refund(dev, size);
        return r;
    }
    *dptr = p;
    return CUDA_SUCCESS;
}

CUresult vmmt__emu_cuMemFree(CUdeviceptr dptr)
{
    int found;

    EMU_ENTER(cuMemFree, 1);
    if (dptr == 0) return CUDA_SUCCESS;
    write_lock();
    found = remove_block(dptr, 0, 0);
    write_unlock();
    return found ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult vmmt__emu_cuMemAllocHost(void **pp, size_t size)
{
    uintptr_t p;
    CUresult r;

    EMU_ENTER(cuMemAllocHost, 1);
    if (vmmt__emu_current_device() < 0) return CUDA_ERROR_INVALID_CONTEXT;
    if (pp == NULL || size == 0) return CUDA_ERROR_INVALID_VALUE;
    if ((r = add_block(size, -1, &p)) != CUDA_SUCCESS) return r;
    *pp = (void *)p;
    return CUDA_SUCCESS;
}

CUresult vmmt__emu_cuMemFreeHost(void *p)
{
    int found;

    EMU_ENTER(cuMemFreeHost, 1);
    write_lock();
    found = p != NULL && remove_block((uintptr_t)p, 1, 0);
    write_unlock();
    return found ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* The range must not overlap a block already known; emu lock held. */
static int overlaps_block(uintptr_t p, size_t n)
{
    for (struct emu_block *b = g_blocks; b != NULL; b = b->next)
        if (p < b->addr + b->size && b->addr < p + n) return 1;
    return 0;
}

CUresult vmmt__emu_cuMemHostRegister(void *p, size_t size, unsigned int flags)
{
    struct emu_block *b;
    CUresult r = CUDA_SUCCESS;

    EMU_ENTER(cuMemHostRegister, 1);
    if (vmmt__emu_current_device() < 0) return CUDA_ERROR_INVALID_CONTEXT;
    if (p == NULL || size == 0 || (flags & ~0x0fu) != 0) return CUDA_ERROR_INVALID_VALUE;
    if ((b = calloc(1, sizeof *b)) == NULL) return CUDA_ERROR_OUT_OF_MEMORY;
    b->addr = (uintptr_t)p;
    b->size = size;
    b->device = -1;
    b->registered = 1;
    vmmt__emu_lock();
    /* The driver refuses to register a range twice. */
    if (overlaps_block(b->addr, size)) {
        r = CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
    } else {
        b->next = g_blocks;
        g_blocks = b;
        g_n_blocks++;
    }
    vmmt__emu_unlock();
    if (r != CUDA_SUCCESS) free(b);
    return r;
}

CUresult vmmt__emu_cuMemHostUnregister(void *p)
{
    int found;

    EMU_ENTER(cuMemHostUnregister, 1);
    write_lock();
    found = p != NULL && remove_block((uintptr_t)p, 1, 1);
    write_unlock();
    return found ? CUDA_SUCCESS : CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
}

CUresult vmmt__emu_cuMemHostGetDevicePointer(CUdeviceptr *d, void *p, unsigned int flags)
{
    int found = 0;

    EMU_ENTER(cuMemHostGetDevicePointer, 1);
    if (d == NULL || p == NULL || flags != 0) return CUDA_ERROR_INVALID_VALUE;
    vmmt__emu_lock();
    for (struct emu_block *b = g_blocks; b != NULL && !found; b = b->next)
        found = b->device < 0 && (uintptr_t)p >= b->addr && (uintptr_t)p < b->addr + b->size;
    vmmt__emu_unlock();
    if (!found) return CUDA_ERROR_INVALID_VALUE;
    /* Unified addressing: the device sees host memory at the host's address. */
    *d = (CUdeviceptr)(uintptr_t)p;
    return CUDA_SUCCESS;
}

/*
 * Only the memory type is asked for: HOST for page-locked host memory
 * (cuMemAllocHost, cuMemHostRegister), DEVICE for device memory, and
 * CUDA_ERROR_INVALID_VALUE for memory the driver does not know (pageable),
 * as the driver answers.
 */
CUresult vmmt__emu_cuPointerGetAttribute(void *data, CUpointer_attribute attribute, CUdeviceptr p)
{
    CUresult r = CUDA_ERROR_INVALID_VALUE;
    unsigned type = 0;

    EMU_ENTER(cuPointerGetAttribute, 1);
    if (data == NULL || attribute != CU_POINTER_ATTRIBUTE_MEMORY_TYPE || p == 0)
        return CUDA_ERROR_INVALID_VALUE;
    vmmt__emu_lock();
    for (struct emu_block *b = g_blocks; b != NULL && type == 0; b = b->next)
        if (p >= b->addr && p < b->addr + b->size)
            type = b->device < 0 ? CU_MEMORYTYPE_HOST : CU_MEMORYTYPE_DEVICE;
    if (type == 0 && map_containing(p) != NULL) type = CU_MEMORYTYPE_DEVICE;
    vmmt__emu_unlock();
    if (type != 0) {
        *(unsigned *)data = type;
        r = CUDA_SUCCESS;
    }
    return r;
}

/*
 * One attribute of p, the current context's device asking; mutex held. A
 * cuMemAlloc block is its device's alone (the emulator grants no peer
 * access to kernels); a mapping is its allocation's, its range is the
 * mapping, and what the device may do there is what cuMemSetAccess granted.
 */
static CUresult attribute_of(CUpointer_attribute a, uintptr_t p, int device, uint64_t *v)
{
    struct emu_block *b = g_blocks;
    struct emu_map *m = NULL;
    uint64_t bit = device >= 0 && device < EMU_MAX_DEVICES ? 1ULL << device : 0;

    while (b != NULL && !(p >= b->addr && p - b->addr < b->size))
        b = b->next;
    if (b == NULL && (m = map_containing(p)) == NULL) return CUDA_ERROR_INVALID_VALUE;
    switch (a) {
    case CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
        *v = b != NULL && b->device < 0 ? CU_MEMORYTYPE_HOST : CU_MEMORYTYPE_DEVICE;
        return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL:
        *v = (uint64_t)(int64_t)(b != NULL ? b->device : m->alloc->host ? -1 : m->alloc->device);
        return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR:
        *v = b != NULL ? b->addr : m->addr;
        return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_RANGE_SIZE: *v = b != NULL ? b->size : m->size; return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_ACCESS_FLAGS:
        if (b != NULL)
            *v = b->device < 0 || b->device == device ? CU_POINTER_ATTRIBUTE_ACCESS_FLAG_READWRITE
                                                      : 0;
        else
            *v = (m->write_mask & bit)  ? CU_POINTER_ATTRIBUTE_ACCESS_FLAG_READWRITE
                 : (m->read_mask & bit) ? CU_POINTER_ATTRIBUTE_ACCESS_FLAG_READ
                                        : 0;
        return CUDA_SUCCESS;
    default: return CUDA_ERROR_INVALID_VALUE;
    }
}

/* Each value is written at the width the driver writes it: 4 bytes, or 8 for addresses and sizes.
 */
CUresult vmmt__emu_cuPointerGetAttributes(unsigned n, CUpointer_attribute *attrs, void **data,
                                          CUdeviceptr p)
{
    int device = vmmt__emu_current_device();
    CUresult r = CUDA_SUCCESS;

    EMU_ENTER(cuPointerGetAttributes, 1);
    if (n == 0 || attrs == NULL || data == NULL) return CUDA_ERROR_INVALID_VALUE;
    if (device < 0) return CUDA_ERROR_INVALID_CONTEXT;
    vmmt__emu_lock();
    for (unsigned i = 0; i < n && r == CUDA_SUCCESS; i++) {
        uint64_t v = 0;
        if (data[i] == NULL) r = CUDA_ERROR_INVALID_VALUE;
        if (r == CUDA_SUCCESS) r = attribute_of(attrs[i], p, device, &v);
        if (r != CUDA_SUCCESS) break;
        if (attrs[i] == CU_POINTER_ATTRIBUTE_RANGE_START_ADDR ||
            attrs[i] == CU_POINTER_ATTRIBUTE_RANGE_SIZE)
            memcpy(data[i], &v, 8);
        else {
            uint32_t w = (uint32_t)v;
            memcpy(data[i], &w, 4);
        }
    }
    vmmt__emu_unlock();
    return r;
}

int vmmt__emu_is_device_memory(uintptr_t p)
{
    for (struct emu_block *b = g_blocks; b != NULL; b = b->next)
        if (p >= b->addr && p < b->addr + b->size) return b->device >= 0;
    return map_containing(p) != NULL;
}

/* ------------------------------------------------------------ validation */

static int in_block(uintptr_t p, uintptr_t end)
{
    for (struct emu_block *b = g_blocks; b != NULL; b = b->next)
        if (p >= b->addr && end <= b->addr + b->size) return 1;
    return 0;
}

CUresult vmmt__emu_range_check(uintptr_t p, size_t n, int device, int need)
{
    uintptr_t cur = p, end = p + n;
    uint64_t bit;

    if (n == 0 || end < p || device < 0 || device >= EMU_MAX_DEVICES)
        return CUDA_ERROR_INVALID_VALUE;
    if (in_block(p, end)) return CUDA_SUCCESS;
    bit = 1ULL << device;
    /* Adjacent mappings form one device range, whatever allocations back them. */
    while (cur < end) {
        struct emu_map *m = map_containing(cur);
        if (m == NULL) return CUDA_ERROR_INVALID_VALUE;
        if ((need & EMU_ACC_READ) && !(m->read_mask & bit)) return CUDA_ERROR_INVALID_VALUE;
        if ((need & EMU_ACC_WRITE) && !(m->write_mask & bit)) return CUDA_ERROR_INVALID_VALUE;
        cur = m->addr + m->size;
    }
    return CUDA_SUCCESS;
}

int vmmt__emu_range_registered(uintptr_t p, size_t n)
{
    for (struct emu_block *b = g_blocks; b != NULL; b = b->next)
        if (b->registered && p >= b->addr && p + n <= b->addr + b->size) return 1;
    return 0;
}

int vmmt__emu_range_imported(uintptr_t p, size_t n)
{
    for (struct emu_map *m = g_maps; m != NULL; m = m->next)
        if (m->alloc->imported && m->addr < p + n && p < m->addr + m->size) return 1;
    return 0;
}

/* ------------------------------------------ address ranges, retained handles */

/*
 * As the driver: the range of the one mapping (cuMemMap call) or cuMemAlloc
 * block that holds dptr. Mappings placed side by side in one reservation are
 * separate ranges, which is how a caller finds every allocation a buffer
 * crosses.
 */
CUresult vmmt__emu_cuMemGetAddressRange(CUdeviceptr *pbase, size_t *psize, CUdeviceptr dptr)
{
    CUresult r = CUDA_ERROR_NOT_FOUND;
    struct emu_map *m;

    EMU_ENTER(cuMemGetAddressRange, 1);
    vmmt__emu_lock();
    if ((m = map_containing(dptr)) != NULL) {
        if (pbase != NULL) *pbase = m->addr;
        if (psize != NULL) *psize = m->size;
        r = CUDA_SUCCESS;
    }
    for (struct emu_block *b = g_blocks; r != CUDA_SUCCESS && b != NULL; b = b->next)
        if (b->device >= 0 && dptr >= b->addr && dptr - b->addr < b->size) {
            if (pbase != NULL) *pbase = b->addr;
            if (psize != NULL) *psize = b->size;
            r = CUDA_SUCCESS;
        }
    vmmt__emu_unlock();
    return r;
}

/*
 * A new reference to the allocation mapped at addr, released with
 * cuMemRelease. The driver hands back the allocation's handle; once the
 * creator released its own, the emulator issues a fresh value.
 */
CUresult vmmt__emu_cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr)
{
    struct emu_map *m;
    CUresult r = CUDA_ERROR_INVALID_VALUE;

    EMU_ENTER(cuMemRetainAllocationHandle, 1);
    if (handle == NULL) return CUDA_ERROR_INVALID_VALUE;
    vmmt__emu_lock();
    if ((m = map_containing((uintptr_t)addr)) != NULL) {
        struct emu_alloc *a = m->alloc;
        if (a->handle == 0)
            a->handle = HANDLE_TAG | ++g_handle_seq;
        else
            a->retains++;
        a->holds++;
        *handle = a->handle;
        r = CUDA_SUCCESS;
    }
    vmmt__emu_unlock();
    return r;
}

CUresult vmmt__emu_cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop,
                                                          CUmemGenericAllocationHandle handle)
{
    struct emu_alloc *a;
    CUresult r = CUDA_ERROR_INVALID_VALUE;

    EMU_ENTER(cuMemGetAllocationPropertiesFromHandle, 1);
    if (prop == NULL) return CUDA_ERROR_INVALID_VALUE;
    vmmt__emu_lock();
    if ((a = find_handle(handle)) != NULL) {
        memset(prop, 0, sizeof *prop);
        prop->type = CU_MEM_ALLOCATION_TYPE_PINNED;
        prop->requestedHandleTypes = (CUmemAllocationHandleType)a->types;
        prop->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        prop->location.id = a->device;
        r = CUDA_SUCCESS;
    }
    vmmt__emu_unlock();
    return r;
}
