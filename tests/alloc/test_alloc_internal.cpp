// White-box tests of the arena engine (alloc/arena.c) through hooks the library keeps hidden:
// the tests link it statically, so they can reach them.
#include "alloc_test_util.hpp"

using namespace alloc_test;

// While n > 0, the free index's next n node chunks are refused as if host memory had run out.
extern "C" void ebb__fx_refuse_chunks(int n);

// Out of host memory for its nodes, the index keeps blocks in its list, searched in the same
// order: the same answers, first from the list alone, then from the list and the tree.
TEST_CASE("internal: the free index keeps the oldest fit when its tree gets no node memory", "[alloc][internal]") {
  EbbSession session;
  check_oldest_fit_model(ebb__fx_refuse_chunks, 2000);
}
