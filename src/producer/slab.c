/*
 * Slice allocator: best fit over free blocks with coalescing.
 *
 * The trees are a small hand-written AVL over an index-linked node array.
 * The libraries that would give us one (a generic tree package) are not on
 * the GPU machine, which has no package manager, and the array lets create
 * allocate every node up front so that alloc and free never call malloc.
 * With L live slices there are at most L + 1 free blocks (free neighbours
 * always merge), so 2 * max_live + 1 nodes are enough.
 */
#include "slab.h"

#include <inttypes.h>
#include <stdlib.h>

#include "status.h"

#define NIL UINT32_MAX
/* Node 0 always holds offset 0: carving keeps the block's node and merging keeps the left one. */
#define HEAD 0u

struct slab_node {
    uint64_t off, size;
    uint32_t prev, next;  /* neighbours by offset; `next` also links spare nodes */
    uint32_t left, right; /* children in the free or the live tree */
    uint8_t height;       /* AVL height of the subtree, 1 for a leaf */
    uint8_t used;         /* a live slice, else a free block */
};

struct vmmt__slab {
    struct slab_node *n;
    uint32_t node_count;
    uint32_t spare, spare_count; /* unused nodes */
    uint32_t free_root;          /* free blocks by (size, offset) */
    uint32_t live_root;          /* live slices by offset */
    uint64_t capacity, free_bytes;
    uint32_t max_live, live, free_blocks;
};

/* ---------------------------------------------------------------- trees */

/* The free tree orders by (size, offset) so a lower bound on size is a best fit. */
struct tkey {
    uint64_t a, b;
};

enum tree_kind { BY_OFFSET = 0, BY_SIZE = 1 };

static struct tkey node_key(const struct vmmt__slab *s, uint32_t i, enum tree_kind kind)
{
    const struct slab_node *x = &s->n[i];
    return kind == BY_SIZE ? (struct tkey){x->size, x->off} : (struct tkey){x->off, 0};
}

static int key_less(struct tkey x, struct tkey y)
{
    return x.a < y.a || (x.a == y.a && x.b < y.b);
}

static int height(const struct vmmt__slab *s, uint32_t i)
{
    return i == NIL ? 0 : s->n[i].height;
}

static void fix_height(struct vmmt__slab *s, uint32_t i)
{
    int l = height(s, s->n[i].left), r = height(s, s->n[i].right);
    s->n[i].height = (uint8_t)(1 + (l > r ? l : r));
}

static uint32_t rotate_right(struct vmmt__slab *s, uint32_t i)
{
    uint32_t l = s->n[i].left;
    s->n[i].left = s->n[l].right;
    s->n[l].right = i;
    fix_height(s, i);
    fix_height(s, l);
    return l;
}

static uint32_t rotate_left(struct vmmt__slab *s, uint32_t i)
{
    uint32_t r = s->n[i].right;
    s->n[i].right = s->n[r].left;
    s->n[r].left = i;
    fix_height(s, i);
    fix_height(s, r);
    return r;
}

static uint32_t rebalance(struct vmmt__slab *s, uint32_t i)
{
    uint32_t l = s->n[i].left, r = s->n[i].right;
    int bf = height(s, l) - height(s, r);

    fix_height(s, i);
    if (bf > 1) {
        if (height(s, s->n[l].left) < height(s, s->n[l].right)) s->n[i].left = rotate_left(s, l);
        return rotate_right(s, i);
    }
    if (bf < -1) {
        if (height(s, s->n[r].right) < height(s, s->n[r].left)) s->n[i].right = rotate_right(s, r);
        return rotate_left(s, i);
    }
    return i;
}

/* Recursion depth is the tree height, at most about 1.44 * log2(nodes). */
static uint32_t tree_insert(struct vmmt__slab *s, uint32_t root, uint32_t x, enum tree_kind kind)
{
    if (root == NIL) {
        s->n[x].left = s->n[x].right = NIL;
        s->n[x].height = 1;
        return x;
    }
    if (key_less(node_key(s, x, kind), node_key(s, root, kind)))
        s->n[root].left = tree_insert(s, s->n[root].left, x, kind);
    else
        s->n[root].right = tree_insert(s, s->n[root].right, x, kind);
    return rebalance(s, root);
}

static uint32_t tree_remove_min(struct vmmt__slab *s, uint32_t root, uint32_t *min)
{
    if (s->n[root].left == NIL) {
        *min = root;
        return s->n[root].right;
    }
    s->n[root].left = tree_remove_min(s, s->n[root].left, min);
    return rebalance(s, root);
}

/* Removes node x, which must be in the tree; keys are unique, so the path to it is too. */
static uint32_t tree_remove(struct vmmt__slab *s, uint32_t root, uint32_t x, enum tree_kind kind)
{
    if (root == x) {
        uint32_t l = s->n[x].left, r = s->n[x].right, m;
        if (r == NIL) return l;
        r = tree_remove_min(s, r, &m);
        s->n[m].left = l;
        s->n[m].right = r;
        return rebalance(s, m);
    }
    if (key_less(node_key(s, x, kind), node_key(s, root, kind)))
        s->n[root].left = tree_remove(s, s->n[root].left, x, kind);
    else
        s->n[root].right = tree_remove(s, s->n[root].right, x, kind);
    return rebalance(s, root);
}

/* The node with the smallest key >= k, or NIL. */
static uint32_t tree_ceil(const struct vmmt__slab *s, uint32_t root, struct tkey k,
                          enum tree_kind kind)
{
    uint32_t best = NIL;
    while (root != NIL) {
        if (!key_less(node_key(s, root, kind), k)) {
            best = root;
            root = s->n[root].left;
        } else {
            root = s->n[root].right;
        }
    }
    return best;
}

/* The node with the largest key <= k, or NIL. */
static uint32_t tree_floor(const struct vmmt__slab *s, uint32_t root, struct tkey k,
                           enum tree_kind kind)
{
    uint32_t best = NIL;
    while (root != NIL) {
        if (!key_less(k, node_key(s, root, kind))) {
            best = root;
            root = s->n[root].right;
        } else {
            root = s->n[root].left;
        }
    }
    return best;
}

static void free_insert(struct vmmt__slab *s, uint32_t i)
{
    s->n[i].used = 0;
    s->free_root = tree_insert(s, s->free_root, i, BY_SIZE);
    s->free_blocks++;
}

static void free_remove(struct vmmt__slab *s, uint32_t i)
{
    s->free_root = tree_remove(s, s->free_root, i, BY_SIZE);
    s->free_blocks--;
}

/* ---------------------------------------------------- nodes and the list */

static uint32_t node_take(struct vmmt__slab *s)
{
    uint32_t i = s->spare;
    s->spare = s->n[i].next;
    s->spare_count--;
    return i;
}

static void node_put(struct vmmt__slab *s, uint32_t i)
{
    s->n[i].next = s->spare;
    s->spare = i;
    s->spare_count++;
}

/* Never before the first block: offset 0 is aligned to everything, so it needs no padding. */
static void list_insert_before(struct vmmt__slab *s, uint32_t b, uint32_t x)
{
    uint32_t p = s->n[b].prev;
    s->n[x].prev = p;
    s->n[x].next = b;
    s->n[b].prev = x;
    s->n[p].next = x;
}

static void list_insert_after(struct vmmt__slab *s, uint32_t a, uint32_t x)
{
    uint32_t nx = s->n[a].next;
    s->n[x].prev = a;
    s->n[x].next = nx;
    s->n[a].next = x;
    if (nx != NIL) s->n[nx].prev = x;
}

/* Only ever called on a block that has a left neighbour. */
static void list_unlink(struct vmmt__slab *s, uint32_t x)
{
    uint32_t p = s->n[x].prev, nx = s->n[x].next;
    s->n[p].next = nx;
    if (nx != NIL) s->n[nx].prev = p;
}

/* ------------------------------------------------------------ create */

int vmmt__slab_create(uint64_t size, uint32_t max_live, struct vmmt__slab **out)
{
    struct vmmt__slab *s = NULL;

    if (out == NULL) return vmmt__fail(VMMT_EINVAL, "slab create: out is NULL");
    *out = NULL;
    if (size == 0)
        return vmmt__fail(VMMT_EINVAL, "slab create: size=0; the data region needs at least "
                                       "one byte");
    /* Node indices are 32-bit with NIL reserved, so 2 * max_live + 1 must stay below it. */
    if (max_live == 0 || max_live > (UINT32_MAX - 2) / 2)
        return vmmt__fail(VMMT_EINVAL,
                          "slab create: max_live=%" PRIu32 " is outside 1..%" PRIu32
                          "; pass the number of control-table slots",
                          max_live, (UINT32_MAX - 2) / 2);

    s = calloc(1, sizeof *s);
    if (s == NULL) goto nomem;
    s->node_count = 2 * max_live + 1;
    s->n = calloc(s->node_count, sizeof *s->n);
    if (s->n == NULL) goto nomem;

    s->capacity = s->free_bytes = size;
    s->max_live = max_live;
    s->live_root = s->free_root = NIL;
    s->spare = NIL;
    for (uint32_t i = s->node_count; i-- > HEAD + 1;)
        node_put(s, i);
    s->n[HEAD] = (struct slab_node){.off = 0, .size = size, .prev = NIL, .next = NIL};
    free_insert(s, HEAD);
    *out = s;
    return VMMT_OK;

nomem:
    vmmt__slab_destroy(s);
    return vmmt__fail(VMMT_ENOMEM,
                      "slab create: cannot allocate %" PRIu32 " nodes for max_live=%" PRIu32
                      "; lower max_live",
                      2 * max_live + 1, max_live);
}

void vmmt__slab_destroy(struct vmmt__slab *s)
{
    if (s == NULL) return;
    free(s->n);
    free(s);
}

/* ------------------------------------------------------------- alloc */

static uint64_t pad_for(uint64_t off, uint64_t align)
{
    return (align - (off & (align - 1))) & (align - 1);
}

static int fits(const struct slab_node *b, uint64_t size, uint64_t align)
{
    uint64_t pad = pad_for(b->off, align);
    return pad <= b->size && b->size - pad >= size;
}

static uint32_t next_by_size(const struct vmmt__slab *s, uint32_t i)
{
    /* Offsets are below capacity, so off + 1 cannot wrap. */
    struct tkey k = {s->n[i].size, s->n[i].off + 1};
    return tree_ceil(s, s->free_root, k, BY_SIZE);
}

/*
 * In (size, offset) order the first block that fits is the best fit. Only
 * misaligned blocks shorter than size + align - 1 can fail to fit, so after
 * a bounded number of those we jump to the first block of that length, which
 * fits at any offset; the scan resumes only when no such block exists, so
 * that EFULL is never answered while something fits.
 */
static uint32_t find_fit(const struct vmmt__slab *s, uint64_t size, uint64_t align)
{
    uint32_t i = tree_ceil(s, s->free_root, (struct tkey){size, 0}, BY_SIZE);

    for (uint32_t seen = 1; i != NIL; seen++, i = next_by_size(s, i)) {
        if (fits(&s->n[i], size, align)) return i;
        if (seen == VMMT__SLAB_SCAN) break;
    }
    if (i == NIL) return NIL;
    if (size <= UINT64_MAX - (align - 1)) {
        uint32_t sure = tree_ceil(s, s->free_root, (struct tkey){size + align - 1, 0}, BY_SIZE);
        if (sure != NIL) return sure;
    }
    for (i = next_by_size(s, i); i != NIL; i = next_by_size(s, i))
        if (fits(&s->n[i], size, align)) return i;
    return NIL;
}

/* Splits free block b into [pad][slice][tail]; pad and tail stay free blocks. */
static void carve(struct vmmt__slab *s, uint32_t b, uint64_t size, uint64_t align)
{
    struct slab_node *x = &s->n[b];
    uint64_t pad = pad_for(x->off, align);

    free_remove(s, b);
    if (pad > 0) {
        uint32_t p = node_take(s);
        s->n[p].off = x->off;
        s->n[p].size = pad;
        list_insert_before(s, b, p);
        x->off += pad;
        x->size -= pad;
        free_insert(s, p);
    }
    if (x->size > size) {
        uint32_t t = node_take(s);
        s->n[t].off = x->off + size;
        s->n[t].size = x->size - size;
        list_insert_after(s, b, t);
        x->size = size;
        free_insert(s, t);
    }
    x->used = 1;
    s->live_root = tree_insert(s, s->live_root, b, BY_OFFSET);
    s->live++;
    s->free_bytes -= size;
}

static int check_alloc_args(const struct vmmt__slab *s, uint64_t size, uint64_t align,
                            const uint64_t *offset)
{
    if (s == NULL || offset == NULL)
        return vmmt__fail(VMMT_EINVAL, "slab alloc: slab or offset is NULL");
    if (size == 0)
        return vmmt__fail(VMMT_EINVAL, "slab alloc: size=0; a slice needs at least one byte");
    if (align == 0 || (align & (align - 1)) != 0 || align > VMMT__SLAB_MAX_ALIGN)
        return vmmt__fail(VMMT_EINVAL,
                          "slab alloc: align=%" PRIu64 " is not a power of two up to %u", align,
                          VMMT__SLAB_MAX_ALIGN);
    if (size > s->capacity)
        return vmmt__fail(VMMT_ETOOBIG,
                          "slab alloc: %" PRIu64 " bytes can never fit the data region of %" PRIu64
                          " bytes; use a larger pool or publish the buffer in parts",
                          size, s->capacity);
    if (s->live == s->max_live)
        return vmmt__fail(VMMT_EFULL,
                          "slab alloc: all %" PRIu32 " slices are live; retry once consumers "
                          "acknowledge, or use more control-table slots",
                          s->max_live);
    return VMMT_OK;
}

int vmmt__slab_alloc(struct vmmt__slab *s, uint64_t size, uint64_t align, uint64_t *offset)
{
    int st = check_alloc_args(s, size, align, offset);
    uint32_t b;

    if (st != VMMT_OK) return st;
    b = find_fit(s, size, align);
    if (b == NIL) {
        struct vmmt__slab_stats t;
        vmmt__slab_stats(s, &t);
        return vmmt__fail(VMMT_EFULL,
                          "slab alloc: no free block fits %" PRIu64 " bytes aligned to %" PRIu64
                          " (%" PRIu64 " of %" PRIu64 " bytes free in %" PRIu32
                          " blocks, largest %" PRIu64 "); retry once consumers acknowledge, "
                          "or use a larger pool",
                          size, align, t.free_bytes, t.capacity, t.free_blocks, t.largest_free);
    }
    /* At most L + 1 free blocks for L live slices, so two spare nodes always remain. */
    if (s->spare_count < 2)
        return vmmt__fail(VMMT_ESTATE,
                          "slab alloc: node storage exhausted with %" PRIu32
                          " live slices; this is a bug in vmmt",
                          s->live);
    carve(s, b, size, align);
    *offset = s->n[b].off;
    return VMMT_OK;
}

/* -------------------------------------------------------------- free */

static int fail_not_live(const struct vmmt__slab *s, uint64_t offset)
{
    uint32_t f = tree_floor(s, s->live_root, (struct tkey){offset, 0}, BY_OFFSET);

    if (f != NIL && offset - s->n[f].off < s->n[f].size)
        return vmmt__fail(VMMT_EINVAL,
                          "slab free: offset=%" PRIu64 " lies inside the live slice at %" PRIu64
                          " (%" PRIu64 " bytes) but is not its start; pass the offset alloc "
                          "returned",
                          offset, s->n[f].off, s->n[f].size);
    return vmmt__fail(VMMT_EINVAL,
                      "slab free: offset=%" PRIu64 " is not a live slice (freed twice, or never "
                      "allocated); free each slice once, with the offset alloc returned",
                      offset);
}

/* Merges free block `right` into its left neighbour `left`, which stays. */
static void merge_into(struct vmmt__slab *s, uint32_t left, uint32_t right)
{
    s->n[left].size += s->n[right].size;
    list_unlink(s, right);
    node_put(s, right);
}

int vmmt__slab_free(struct vmmt__slab *s, uint64_t offset)
{
    uint32_t i, p, nx;

    if (s == NULL) return vmmt__fail(VMMT_EINVAL, "slab free: slab is NULL");
    i = tree_ceil(s, s->live_root, (struct tkey){offset, 0}, BY_OFFSET);
    if (i == NIL || s->n[i].off != offset) return fail_not_live(s, offset);

    s->live_root = tree_remove(s, s->live_root, i, BY_OFFSET);
    s->live--;
    s->free_bytes += s->n[i].size;
    s->n[i].used = 0;

    p = s->n[i].prev;
    if (p != NIL && !s->n[p].used) {
        free_remove(s, p);
        merge_into(s, p, i);
        i = p;
    }
    nx = s->n[i].next;
    if (nx != NIL && !s->n[nx].used) {
        free_remove(s, nx);
        merge_into(s, i, nx);
    }
    free_insert(s, i);
    return VMMT_OK;
}

/* ------------------------------------------------------------- stats */

void vmmt__slab_stats(const struct vmmt__slab *s, struct vmmt__slab_stats *out)
{
    uint32_t i = s->free_root;

    while (i != NIL && s->n[i].right != NIL)
        i = s->n[i].right;
    *out = (struct vmmt__slab_stats){
        .capacity = s->capacity,
        .free_bytes = s->free_bytes,
        .largest_free = i == NIL ? 0 : s->n[i].size,
        .live = s->live,
        .free_blocks = s->free_blocks,
    };
}

/* ------------------------------------------------------------- check */

struct walk {
    const struct vmmt__slab *s;
    enum tree_kind kind;
    int have_prev, bad;
    struct tkey prev;
    uint32_t count;
};

/* In-order walk: returns the subtree height, sets bad on disorder, imbalance or a wrong kind. */
static int walk_tree(struct walk *w, uint32_t i, int depth)
{
    const struct slab_node *x;
    int hl, hr;

    if (i == NIL || w->bad) return 0;
    if (i >= w->s->node_count || depth > 64) {
        w->bad = 1;
        return 0;
    }
    x = &w->s->n[i];
    hl = walk_tree(w, x->left, depth + 1);
    if (w->have_prev && !key_less(w->prev, node_key(w->s, i, w->kind))) w->bad = 1;
    if (x->used != (w->kind == BY_OFFSET)) w->bad = 1;
    w->prev = node_key(w->s, i, w->kind);
    w->have_prev = 1;
    w->count++;
    hr = walk_tree(w, x->right, depth + 1);
    if (hl - hr > 1 || hr - hl > 1 || x->height != 1 + (hl > hr ? hl : hr)) w->bad = 1;
    return 1 + (hl > hr ? hl : hr);
}

static int check_tree(const struct vmmt__slab *s, uint32_t root, enum tree_kind kind,
                      uint32_t expect)
{
    struct walk w = {.s = s, .kind = kind};

    walk_tree(&w, root, 0);
    if (w.bad || w.count != expect)
        return vmmt__fail(VMMT_ESTATE,
                          "slab check: the %s tree is unordered, unbalanced or holds %" PRIu32
                          " nodes where the list has %" PRIu32,
                          kind == BY_SIZE ? "free" : "live", w.count, expect);
    return VMMT_OK;
}

static int check_list(const struct vmmt__slab *s, uint32_t *nfree, uint32_t *nlive)
{
    uint64_t end = 0, free_bytes = 0;
    uint32_t prev = NIL, steps = 0;

    *nfree = *nlive = 0;
    for (uint32_t i = HEAD; i != NIL; prev = i, i = s->n[i].next) {
        const struct slab_node *x = &s->n[i];
        if (++steps > s->node_count || x->prev != prev || x->off != end || x->size == 0)
            return vmmt__fail(VMMT_ESTATE, "slab check: block list broken at offset %" PRIu64, end);
        if (!x->used && prev != NIL && !s->n[prev].used)
            return vmmt__fail(VMMT_ESTATE,
                              "slab check: free blocks at %" PRIu64 " and %" PRIu64
                              " are adjacent but not merged",
                              s->n[prev].off, x->off);
        /* Each block must be the one its tree finds under its own key. */
        enum tree_kind kind = x->used ? BY_OFFSET : BY_SIZE;
        uint32_t root = x->used ? s->live_root : s->free_root;
        if (tree_ceil(s, root, node_key(s, i, kind), kind) != i)
            return vmmt__fail(VMMT_ESTATE, "slab check: block at %" PRIu64 " is not in its tree",
                              x->off);
        end += x->size;
        if (x->used)
            (*nlive)++;
        else
            (*nfree)++, free_bytes += x->size;
    }
    if (end != s->capacity || free_bytes != s->free_bytes)
        return vmmt__fail(VMMT_ESTATE,
                          "slab check: blocks cover %" PRIu64 " of %" PRIu64 " bytes, %" PRIu64
                          " free where the counter says %" PRIu64,
                          end, s->capacity, free_bytes, s->free_bytes);
    if (steps + s->spare_count != s->node_count)
        return vmmt__fail(VMMT_ESTATE,
                          "slab check: %" PRIu32 " blocks + %" PRIu32 " spare nodes != %" PRIu32,
                          steps, s->spare_count, s->node_count);
    return VMMT_OK;
}

int vmmt__slab_check(const struct vmmt__slab *s)
{
    uint32_t nfree, nlive;
    int st = check_list(s, &nfree, &nlive);

    if (st != VMMT_OK) return st;
    if (nfree != s->free_blocks || nlive != s->live || nlive > s->max_live)
        return vmmt__fail(VMMT_ESTATE,
                          "slab check: list has %" PRIu32 " free and %" PRIu32
                          " live blocks, counters say %" PRIu32 " and %" PRIu32,
                          nfree, nlive, s->free_blocks, s->live);
    st = check_tree(s, s->free_root, BY_SIZE, nfree);
    if (st == VMMT_OK) st = check_tree(s, s->live_root, BY_OFFSET, nlive);
    return st;
}
