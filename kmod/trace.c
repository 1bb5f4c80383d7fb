// SPDX-License-Identifier: GPL-2.0 OR MIT
/* The one place that instantiates the tracepoints of trace.h. */
#define CREATE_TRACE_POINTS
#include "trace.h"
