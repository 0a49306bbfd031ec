#include "framework/backend/cuda/mark_written.h"

#include <nvtx3/nvToolsExtMemCudaRt.h>

namespace hp::cuda {

void mark_written(const void* p, size_t bytes, cudaStream_t stream) {
  static nvtxDomainHandle_t domain = nvtxDomainCreateA("hotpath");
  const nvtxMemVirtualRangeDesc_t range{bytes, const_cast<void*>(p)};
  nvtxMemMarkInitializedBatch_t batch{};
  batch.extCompatID = NVTX_EXT_COMPATID_MEM;
  batch.structSize = sizeof(batch);
  batch.regionType = NVTX_MEM_TYPE_VIRTUAL_ADDRESS;
  batch.regionDescCount = 1;
  batch.regionDescElementSize = sizeof(range);
  batch.regionDescElements = &range;
  nvtxMemCudaMarkInitialized(domain, stream, 0, &batch);
}

}  // namespace hp::cuda
