/*
 * The broker protocol the fuzz targets check: version 3 (src/wire/broker_wire.h,
 * docs/broker.md). Both sides' parsers are reached without a socket, through
 * the pure entry points the broker keeps for this: the server's request check
 * (vmmt__breq_parse) and link-message check (vmmt__bmsg_parse), and the
 * client's reply check (vmmt__brep_check, the check a fetch runs on what
 * recvmsg returned).
 */
#ifndef VMMT_FUZZ_BROKER_PROTO_H
#define VMMT_FUZZ_BROKER_PROTO_H

#include "broker.h"
#include "broker_wire.h"

#define FUZZ_PROTO      VMMT__BROKER_PROTO
#define FUZZ_REPLY_HEAD VMMT__BREP_HEAD
#define FUZZ_REQ_FLAGS  VMMT__BREQ_FLAGS

#endif
