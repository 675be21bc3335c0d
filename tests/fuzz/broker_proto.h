/*
 * The broker protocol the fuzz targets check: version 3 where src/ has its
 * wire header (broker_wire.h, with liveness links and the pool id in the
 * reply), version 2 otherwise. Both sides' parsers are reached without a
 * socket: the request check (vmmt__breq_parse, or vmmt__broker_request_problem
 * in version 2), the link-message check (version 3 only, vmmt__bmsg_parse),
 * and the client's reply check (vmmt__broker_parse_reply, a thin wrapper
 * beside the client's own).
 */
#ifndef VMMT_FUZZ_BROKER_PROTO_H
#define VMMT_FUZZ_BROKER_PROTO_H

#include "broker.h"

#if __has_include("broker_wire.h")
#include "broker_wire.h"
#define FUZZ_PROTO      VMMT__BROKER_PROTO
#define FUZZ_REPLY_HEAD VMMT__BREP_HEAD
#define FUZZ_REQ_FLAGS  VMMT__BREQ_FLAGS
#define FUZZ_HAVE_LINKS 1
#else
#define FUZZ_PROTO      2
#define FUZZ_REPLY_HEAD 14
#define FUZZ_REQ_FLAGS  0
#define FUZZ_HAVE_LINKS 0
#endif

#endif
