/* topo.c: which NUMA node and cores are nearest each device, from hwloc, and binding a thread
 * there.
 *
 * On a GPU the device's PCI bus id locates its PCI object in the hwloc topology; its first
 * non-I/O ancestor gives the cores and NUMA node. Where that fails (the emulated driver's bus
 * ids are not real PCI devices, or the OS hides PCI), devices are spread round-robin over the
 * machine's NUMA nodes, and `from_pci` says so.
 *
 * Threading: the topology is loaded in ebb_init and destroyed in the last ebb_shutdown, both
 * under the runtime lock; in between it is only read (hwloc allows concurrent readers), and
 * binding works on the calling thread only.
 */
#include <errno.h>
#include <hwloc.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "runtime_impl.h"

static hwloc_topology_t ebb__topo;
static hwloc_cpuset_t ebb__dev_cpuset[EBB_MAX_DEVICES];

static void topo_fill(int i) {
  ebb_topo *t = &ebb__runtime_state.dev[i].topo;
  memset(t, 0, sizeof *t);
  t->numa_node = -1;
  int nnodes = hwloc_get_nbobjs_by_type(ebb__topo, HWLOC_OBJ_NUMANODE);
  t->numa_nodes = nnodes > 0 ? nnodes : 1;
  hwloc_cpuset_t set = hwloc_bitmap_alloc();
  hwloc_obj_t anc = NULL;
  unsigned dom = 0, bus = 0, dev = 0, fn = 0;
  const char *busid = ebb__runtime_state.dev[i].caps.pci_bus_id;
  if (busid[0] && sscanf(busid, "%x:%x:%x.%x", &dom, &bus, &dev, &fn) == 4) {
    hwloc_obj_t pci = hwloc_get_pcidev_by_busid(ebb__topo, dom, bus, dev, fn);
    if (pci) anc = hwloc_get_non_io_ancestor_obj(ebb__topo, pci);
  }
  if (anc && anc->cpuset) {
    hwloc_bitmap_copy(set, anc->cpuset);
    t->from_pci = true;
    hwloc_obj_t node = hwloc_get_next_obj_covering_cpuset_by_type(ebb__topo, set, HWLOC_OBJ_NUMANODE, NULL);
    if (node) t->numa_node = (int)node->logical_index;
  } else {
    /* Spread: device i on node i mod nodes (node 0 on a machine without NUMA information). */
    hwloc_obj_t node = nnodes > 0 ? hwloc_get_obj_by_type(ebb__topo, HWLOC_OBJ_NUMANODE, (unsigned)(i % nnodes)) : NULL;
    if (node && node->cpuset) {
      hwloc_bitmap_copy(set, node->cpuset);
      t->numa_node = (int)node->logical_index;
    } else {
      hwloc_bitmap_copy(set, hwloc_topology_get_topology_cpuset(ebb__topo));
      t->numa_node = 0;
    }
  }
  t->ncores = hwloc_get_nbobjs_inside_cpuset_by_type(ebb__topo, set, HWLOC_OBJ_CORE);
  hwloc_bitmap_list_snprintf(t->cpus, sizeof t->cpus, set);
  ebb__dev_cpuset[i] = set;
}

void ebb__topo_init(void) {
  if (hwloc_topology_init(&ebb__topo) != 0) {
    ebb__topo = NULL;
    return;
  }
  /* PCI objects are needed to place real GPUs (bridges and OS devices are not). Emulated devices
   * have no PCI location, so the PCI scan, its plugins and their cost are skipped for them. */
  bool any_pci = false;
  for (int i = 0; i < ebb__runtime_state.ndev; i++) any_pci |= !ebb__runtime_state.dev[i].caps.emulated && ebb__runtime_state.dev[i].caps.pci_bus_id[0];
  if (any_pci) hwloc_topology_set_io_types_filter(ebb__topo, HWLOC_TYPE_FILTER_KEEP_IMPORTANT);
  if (hwloc_topology_load(ebb__topo) != 0) {
    hwloc_topology_destroy(ebb__topo);
    ebb__topo = NULL;
    return;
  }
  for (int i = 0; i < ebb__runtime_state.ndev; i++) topo_fill(i);
}

void ebb__topo_fini(void) {
  for (int i = 0; i < EBB_MAX_DEVICES; i++) {
    if (ebb__dev_cpuset[i]) hwloc_bitmap_free(ebb__dev_cpuset[i]);
    ebb__dev_cpuset[i] = NULL;
  }
  if (ebb__topo) hwloc_topology_destroy(ebb__topo);
  ebb__topo = NULL;
}

ebb_status ebb_dev_get_topo(int device, ebb_topo *out) {
  ebb_status st = ebb__check_dev("ebb_dev_get_topo", device);
  if (st) return st;
  if (!out) return ebb__fail(EBB_EINVAL, "ebb_dev_get_topo: out is NULL; expected a struct to fill");
  if (!ebb__topo) return ebb__fail(EBB_ENOTSUP, "ebb_dev_get_topo: hwloc could not load the machine's topology");
  *out = ebb__runtime_state.dev[device].topo;
  return EBB_OK;
}

ebb_status ebb_thread_bind_device(int device) {
  ebb_status st = ebb__check_dev("ebb_thread_bind_device", device);
  if (st) return st;
  if (!ebb__topo || !ebb__dev_cpuset[device])
    return ebb__fail(EBB_ENOTSUP, "ebb_thread_bind_device: no topology for device %d (hwloc did not load)", device);
  if (hwloc_set_cpubind(ebb__topo, ebb__dev_cpuset[device], HWLOC_CPUBIND_THREAD) != 0)
    return ebb__fail(EBB_ENOTSUP, "ebb_thread_bind_device: the OS refused to bind this thread to cores %s of device %d",
                     ebb__runtime_state.dev[device].topo.cpus, device);
  return EBB_OK;
}

/* ---- NUMA-placed host memory ---------------------------------------------------------------
 * The pages are mapped here and hwloc asks the kernel (mbind) to place them on the node's
 * memory; the kernel honours it at first touch. Where binding is refused the pages are still usable, only
 * unplaced, and the caller is told so through *bound. */

static hwloc_obj_t numa_obj(int device) {
  if (!ebb__topo) return NULL;
  int node = ebb__runtime_state.dev[device].topo.numa_node;
  return node < 0 ? NULL : hwloc_get_obj_by_type(ebb__topo, HWLOC_OBJ_NUMANODE, (unsigned)node);
}

static size_t page_round(size_t bytes) {
  long pg = sysconf(_SC_PAGESIZE);
  size_t p = pg > 0 ? (size_t)pg : 4096;
  return (bytes + p - 1) / p * p;
}

ebb_status ebb_numa_pages_alloc(int device, size_t bytes, void **out, bool *bound) {
  static const char fn[] = "ebb_numa_pages_alloc";
  ebb_status st = ebb__check_dev(fn, device);
  if (st) return st;
  if (!out || !bound) return ebb__fail(EBB_EINVAL, "%s: out or bound is NULL; expected pointers to fill", fn);
  if (!bytes) return ebb__fail(EBB_EINVAL, "%s: bytes is 0; expected a size of at least one byte", fn);
  size_t len = page_round(bytes);
  void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED)
    return ebb__fail(EBB_ENOMEM, "%s: the system has no %zu bytes of host memory left for device %d: %s", fn, len, device,
                     strerror(errno));
  /* STRICT: report a refused binding instead of silently leaving the pages unplaced. */
  hwloc_obj_t node = numa_obj(device);
  *bound = node && node->nodeset &&
           hwloc_set_area_membind(ebb__topo, p, len, node->nodeset, HWLOC_MEMBIND_BIND,
                                  HWLOC_MEMBIND_BYNODESET | HWLOC_MEMBIND_STRICT) == 0;
  *out = p;
  return EBB_OK;
}

ebb_status ebb_numa_pages_free(void *p, size_t bytes) {
  if (!p) return EBB_OK;
  if (munmap(p, page_round(bytes)) != 0)
    return ebb__fail(EBB_EINVAL, "ebb_numa_pages_free: munmap of %p (%zu bytes) failed: %s", p, bytes, strerror(errno));
  return EBB_OK;
}

ebb_status ebb_host_numa_node(const void *p, size_t bytes, int *node) {
  static const char fn[] = "ebb_host_numa_node";
  if (!p || !node) return ebb__fail(EBB_EINVAL, "%s: p or node is NULL; expected a host range and an int to fill", fn);
  if (!ebb__topo) return ebb__fail(EBB_ENOTSUP, "%s: hwloc did not load the machine's topology", fn);
  hwloc_nodeset_t set = hwloc_bitmap_alloc();
  if (!set) return ebb__fail(EBB_ENOMEM, "%s: no host memory for a node set", fn);
  ebb_status st = EBB_OK;
  if (hwloc_get_area_memlocation(ebb__topo, p, bytes, set, HWLOC_MEMBIND_BYNODESET) != 0 || hwloc_bitmap_iszero(set)) {
    st = ebb__fail(EBB_ENOTSUP, "%s: the OS cannot tell where the pages of %p (%zu bytes) are", fn, p, bytes);
  } else if (hwloc_bitmap_weight(set) != 1) {
    *node = -1;
  } else {
    hwloc_obj_t o = hwloc_get_numanode_obj_by_os_index(ebb__topo, (unsigned)hwloc_bitmap_first(set));
    *node = o ? (int)o->logical_index : -1;
  }
  hwloc_bitmap_free(set);
  return st;
}
