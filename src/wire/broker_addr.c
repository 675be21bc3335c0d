/*
 * Broker addresses as people write them ("@name" or a path) and as the
 * kernel takes them (struct sockaddr_un), for the server and the client.
 */
#include "broker_addr.h"

#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <sys/un.h>

#include "broker.h"
#include "broker_wire.h"
#include "status.h"

const char *vmmt__broker_addr_format(const struct vmmt__broker_addr *addr, char *buf, size_t cap)
{
    size_t n = 0;

    if (cap == 0) return buf;
    buf[0] = '\0';
    if (addr == NULL) return buf;
    if (addr->kind == VMMT_BROKER_ADDR_ABSTRACT && cap > 1) buf[n++] = '@';
    for (size_t i = 0; i < addr->len && i < sizeof addr->name && n + 1 < cap; i++) {
        unsigned char c = (unsigned char)addr->name[i];
        if (c >= 0x20 && c < 0x7f) {
            buf[n++] = (char)c;
        } else if (n + 5 < cap) {
            snprintf(buf + n, 5, "\\x%02x", c);
            n += 4;
        } else {
            break;
        }
    }
    buf[n] = '\0';
    return buf;
}

int vmmt__broker_addr_parse(const char *text, struct vmmt__broker_addr *out)
{
    size_t n;
    int kind = VMMT_BROKER_ADDR_PATH;

    if (text == NULL || out == NULL)
        return vmmt__fail(VMMT_EINVAL, "broker address: text and out must not be NULL");
    if (text[0] == '@') {
        kind = VMMT_BROKER_ADDR_ABSTRACT;
        text++;
    }
    n = strlen(text);
    if (n == 0 || n > sizeof out->name - 1)
        return vmmt__fail(VMMT_EINVAL,
                          "broker address \"%s\" has %zu bytes; a name needs 1 to %zu bytes", text,
                          n, sizeof out->name - 1);
    memset(out, 0, sizeof *out);
    out->kind = (uint8_t)kind;
    out->len = (uint8_t)n;
    memcpy(out->name, text, n);
    return VMMT_OK;
}

int vmmt__broker_addr_check(const struct vmmt__broker_addr *addr)
{
    if (addr->kind != VMMT_BROKER_ADDR_ABSTRACT && addr->kind != VMMT_BROKER_ADDR_PATH)
        return vmmt__fail(VMMT_EINVAL,
                          "broker address kind %u is unknown; expected 0 (abstract) or 1 (path)",
                          addr->kind);
    if (addr->len == 0 || addr->len > sizeof addr->name - 1)
        return vmmt__fail(VMMT_EINVAL, "broker address length %u is outside 1..%zu", addr->len,
                          sizeof addr->name - 1);
    /* A path with a NUL inside would name a different file than the one printed. */
    if (addr->kind == VMMT_BROKER_ADDR_PATH && memchr(addr->name, '\0', addr->len) != NULL)
        return vmmt__fail(VMMT_EINVAL, "broker path contains a NUL byte");
    return VMMT_OK;
}

socklen_t vmmt__broker_sockaddr(const struct vmmt__broker_addr *addr, struct sockaddr_un *sun)
{
    memset(sun, 0, sizeof *sun);
    sun->sun_family = AF_UNIX;
    if (addr->kind == VMMT_BROKER_ADDR_ABSTRACT) {
        memcpy(sun->sun_path + 1, addr->name, addr->len);
        return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + addr->len);
    }
    memcpy(sun->sun_path, addr->name, addr->len);
    return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + addr->len + 1);
}
