/* ebb/ebb.h: every public ebb header, for callers that want the whole API in one include. */
#ifndef EBB_EBB_H
#define EBB_EBB_H

#include "ebb/status.h"
#include "ebb/runtime.h"
#include "ebb/trace.h"
#include "ebb/stream.h"
#include "ebb/alloc.h"
#include "ebb/tensor.h"
#include "ebb/ops.h"
#include "ebb/autograd.h"
#include "ebb/optim.h"
#include "ebb/function.h"
#include "ebb/map.h"
#include "ebb/custom_op.h"
#include "ebb/dist.h"
#include "ebb/ddp.h"

#endif /* EBB_EBB_H */
