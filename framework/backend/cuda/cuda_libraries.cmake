# Libraries of the CUDA backend beyond the CUDA runtime and cuBLAS, for hotpath_backend.
#
# CUPTI: device-time step profiles (cuda_profiler.cpp).
target_link_libraries(hotpath_backend PUBLIC CUDA::cupti)

# cuDNN's fused attention through the cuDNN frontend: header-only C++ over cuDNN's backend API,
# with libcudnn loaded at run time, so a binary built with it still runs (on the in-house
# kernels) where cuDNN is absent. The frontend headers come from the nvidia-cudnn-frontend wheel
# (launch/setup.sh unpacks it into build/_deps/cudnn_frontend); cudnn.h from the CUDA toolkit,
# the system, or HOTPATH_CUDNN_INCLUDE_DIR.
set(HOTPATH_CUDNN_FRONTEND_DIR "${PROJECT_SOURCE_DIR}/build/_deps/cudnn_frontend/include"
    CACHE PATH "Directory holding cudnn_frontend.h")
set(HOTPATH_CUDNN_INCLUDE_DIR "" CACHE PATH "Directory holding cudnn.h (cuDNN 9)")
find_path(HP_CUDNN_FRONTEND_INCLUDE cudnn_frontend.h HINTS ${HOTPATH_CUDNN_FRONTEND_DIR}
          NO_DEFAULT_PATH)
find_path(HP_CUDNN_INCLUDE cudnn.h HINTS ${HOTPATH_CUDNN_INCLUDE_DIR} ${CUDAToolkit_INCLUDE_DIRS})
if(HP_CUDNN_FRONTEND_INCLUDE AND HP_CUDNN_INCLUDE)
  message(STATUS "cuDNN attention: on (frontend ${HP_CUDNN_FRONTEND_INCLUDE}, cudnn.h in "
                 "${HP_CUDNN_INCLUDE})")
  target_include_directories(hotpath_backend SYSTEM PRIVATE ${HP_CUDNN_FRONTEND_INCLUDE}
                                                            ${HP_CUDNN_INCLUDE})
  target_compile_definitions(hotpath_backend PUBLIC HOTPATH_HAVE_CUDNN=1)
  target_compile_definitions(hotpath_backend PRIVATE NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING=1)
  target_link_libraries(hotpath_backend PRIVATE ${CMAKE_DL_LIBS})
else()
  message(STATUS "cuDNN attention: off (cudnn_frontend.h: ${HP_CUDNN_FRONTEND_INCLUDE}, cudnn.h: "
                 "${HP_CUDNN_INCLUDE}); the in-house attention kernels are used")
endif()
