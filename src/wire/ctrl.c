/*
 * The shared host control table: a memfd mapped in the producer and every
 * consumer, registered with the driver so that GPU streams write the ready
 * and acknowledgement words straight into it.
 */
#include "ctrl.h"

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "driver.h"
#include "status.h"

/* Seals of a control table: its size is fixed for good. */
#define VMMT__CTRL_SEALS (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)

static size_t page_round(size_t n)
{
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    return (n + page - 1) / page * page;
}

int vmmt__ctrl_register(struct vmmt__ctrl *c)
{
    const struct vmmt_drv *d = vmmt__drv();
    int st;

    if (c->registered) return VMMT_OK;
    /* PORTABLE: a consumer may serve several devices from one mapping. */
    st = VMMT_CU(d, cuMemHostRegister(c->base, c->bytes,
                                      CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP));
    if (st != VMMT_OK) return vmmt__wrap(st, "registering the control table with the driver");
    st = VMMT_CU(d, cuMemHostGetDevicePointer(&c->dev, c->base, 0));
    if (st != VMMT_OK) {
        /* Half done is not done: the next call tries the whole again. */
        d->cuMemHostUnregister(c->base);
        c->dev = 0;
        return st;
    }
    c->dev += VMMT__CTRL_RECORD_BYTES; /* the rows */
    c->registered = 1;
    return VMMT_OK;
}

/* Map fd and (optionally) register the mapping; fills c->base, c->host, c->dev, c->registered. */
static int map_and_register(int fd, int register_with_driver, struct vmmt__ctrl *c)
{
    void *p;

    p = mmap(NULL, c->bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) return vmmt__sys_fail("mapping the control table (%zu bytes)", c->bytes);
    c->base = p;
    c->host = (uint32_t *)((uint8_t *)p + VMMT__CTRL_RECORD_BYTES);
    return register_with_driver ? vmmt__ctrl_register(c) : VMMT_OK;
}

static void init(struct vmmt__ctrl *c, size_t bytes)
{
    memset(c, 0, sizeof *c);
    c->fd = -1;
    c->bytes = page_round(bytes);
}

static int create_shared(size_t bytes, int register_with_driver, struct vmmt__ctrl *c)
{
    int st;

    init(c, bytes);
    c->fd = memfd_create("vmmt-control", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    /*
     * Refused outright (a container's seccomp profile, an LSM) is not a
     * failure of the moment: VMMT_ENOTSUP tells the pool to keep its table
     * elsewhere where it can, instead of failing the way a full fd table does.
     */
    if (c->fd < 0 && (errno == ENOSYS || errno == EPERM || errno == EACCES))
        return vmmt__fail(VMMT_ENOTSUP,
                          "memfd_create for the control table: %s (refused by the kernel or a "
                          "seccomp filter)",
                          strerror(errno));
    if (c->fd < 0) return vmmt__sys_fail("memfd_create for the control table");
    if (ftruncate(c->fd, (off_t)c->bytes) != 0) {
        st = vmmt__sys_fail("sizing the control table to %zu bytes", c->bytes);
        goto fail;
    }
    /* Every consumer gets this fd read-write: sealed, none can shrink it under the others'
     * mappings (SIGBUS), nor grow it, nor add or remove seals. */
    if (fcntl(c->fd, F_ADD_SEALS, VMMT__CTRL_SEALS) != 0) {
        st = vmmt__sys_fail("sealing the control table against resizing");
        goto fail;
    }
    st = map_and_register(c->fd, register_with_driver, c);
    if (st == VMMT_OK) return VMMT_OK;
fail:
    vmmt__ctrl_release(c);
    return st;
}

int vmmt__ctrl_create_shared(size_t bytes, struct vmmt__ctrl *c)
{
    return create_shared(bytes, 1, c);
}

int vmmt__ctrl_create_shared_unregistered(size_t bytes, struct vmmt__ctrl *c)
{
    return create_shared(bytes, 0, c);
}

static const uint8_t record_magic[4] = {'P', 'O', 'O', 'L'};

static void put_u32le(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static uint32_t get_u32le(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static void put_u64le(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static uint64_t get_u64le(const uint8_t *p)
{
    return (uint64_t)get_u32le(p) | (uint64_t)get_u32le(p + 4) << 32;
}

/* Offsets in the record. */
#define REC_SLOTS     4
#define REC_STRIDE    8
#define REC_CONSUMERS 12
#define REC_POOL_ID   16
#define REC_TABLE     32
#define REC_DATA      40
#define REC_KEY       48

void vmmt__ctrl_record_encode(const struct vmmt__ctrl_record *r,
                              uint8_t out[VMMT__CTRL_RECORD_BYTES])
{
    memcpy(out, record_magic, sizeof record_magic);
    put_u32le(out + REC_SLOTS, r->slots);
    put_u32le(out + REC_STRIDE, r->stride);
    put_u32le(out + REC_CONSUMERS, r->consumers);
    memcpy(out + REC_POOL_ID, r->pool_id, sizeof r->pool_id);
    put_u64le(out + REC_TABLE, r->table_offset);
    put_u64le(out + REC_DATA, r->data_offset);
    memcpy(out + REC_KEY, r->key, VMMT__SEAL_KEY_BYTES);
}

int vmmt__ctrl_record_check(const uint8_t in[VMMT__CTRL_RECORD_BYTES],
                            struct vmmt__ctrl_record *want, const char *where)
{
    uint32_t slots = get_u32le(in + REC_SLOTS), stride = get_u32le(in + REC_STRIDE),
             consumers = get_u32le(in + REC_CONSUMERS);
    uint64_t table = get_u64le(in + REC_TABLE), data = get_u64le(in + REC_DATA);

    if (memcmp(in, record_magic, sizeof record_magic) != 0)
        return vmmt__fail(VMMT_EPROTO,
                          "%s does not start with a pool record; the descriptor is not this "
                          "pool's, or the producer runs another vmmt version; nothing was "
                          "imported",
                          where);
    if (memcmp(in + REC_POOL_ID, want->pool_id, sizeof want->pool_id) != 0)
        return vmmt__fail(VMMT_EPROTO,
                          "%s belongs to another pool than the descriptor's pool_id: the "
                          "descriptor names one pool and the allocation of another (altered, "
                          "or made by another producer); nothing was imported",
                          where);
    if (slots != want->slots || stride != want->stride || consumers != want->consumers)
        return vmmt__fail(VMMT_EPROTO,
                          "%s has %u slots x %u bytes for %u consumers, the descriptor says "
                          "%u x %u for %u: the descriptor was altered or belongs to another "
                          "pool; nothing was imported",
                          where, slots, stride, consumers, want->slots, want->stride,
                          want->consumers);
    if (table != want->table_offset || data != want->data_offset)
        return vmmt__fail(VMMT_EPROTO,
                          "%s puts the rows at %llu and the data at %llu, the descriptor says "
                          "%llu and %llu: the descriptor was altered; nothing was imported",
                          where, (unsigned long long)table, (unsigned long long)data,
                          (unsigned long long)want->table_offset,
                          (unsigned long long)want->data_offset);
    memcpy(want->key, in + REC_KEY, VMMT__SEAL_KEY_BYTES);
    return VMMT_OK;
}

int vmmt__ctrl_attach_shared(int fd, size_t at, struct vmmt__ctrl_record *rec,
                             int register_with_driver, struct vmmt__ctrl *c)
{
    struct stat sb;
    int st, seals;

    init(c, VMMT__CTRL_RECORD_BYTES + at);
    if (fstat(fd, &sb) != 0) return vmmt__sys_fail("fstat of the control table descriptor");
    /* Exactly the producer's size: the descriptor's table_slots and slot_stride must describe
     * what was really served, or they are not this pool's. */
    if (!S_ISREG(sb.st_mode) || (uint64_t)sb.st_size != c->bytes)
        return vmmt__fail(VMMT_EPROTO,
                          "the control table the broker sent has %lld bytes, the descriptor "
                          "(table_slots x slot_stride, in whole pages) says %zu; the descriptor "
                          "or the broker belongs to another pool or version",
                          (long long)sb.st_size, c->bytes);
    seals = fcntl(fd, F_GET_SEALS);
    if (seals < 0 || (seals & VMMT__CTRL_SEALS) != VMMT__CTRL_SEALS)
        return vmmt__fail(VMMT_EPROTO,
                          "the control table the broker sent is not sealed against resizing "
                          "(seals 0x%x, need 0x%x): any process holding it could shrink it "
                          "and crash every user with SIGBUS; refusing it (is the producer a "
                          "vmmt of this version?)",
                          seals < 0 ? 0 : (unsigned)seals, (unsigned)VMMT__CTRL_SEALS);
    st = map_and_register(fd, register_with_driver, c);
    if (st == VMMT_OK)
        st = vmmt__ctrl_record_check(c->base, rec, "the control table the broker sent");
    if (st != VMMT_OK) vmmt__ctrl_release(c);
    return st;
}

void vmmt__ctrl_release(struct vmmt__ctrl *c)
{
    const struct vmmt_drv *d = vmmt__drv();
    struct vmmt__saved_error e;

    vmmt__error_save(&e);
    /* Still registered, the pages must stay mapped: unmapped, their addresses
     * could be mapped again and meet the stale registration. */
    if (c->registered && d != NULL && d->cuMemHostUnregister(c->base) != CUDA_SUCCESS)
        vmmt__log(VMMT_LOG_ERROR,
                  "unregistering the control table failed; its %zu bytes stay mapped (leaked)",
                  c->bytes);
    else if (c->base != NULL)
        munmap(c->base, c->bytes);
    c->registered = 0;
    c->base = NULL;
    c->host = NULL;
    c->dev = 0;
    if (c->fd >= 0) close(c->fd);
    c->fd = -1;
    vmmt__error_restore(&e);
}
