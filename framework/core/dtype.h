// Element types and devices of tensors.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

namespace hp {

// F64 exists for the CPU reference's finite-difference checks; training uses F32 (CPU) or
// BF16 activations with F32 masters (CUDA).
enum class DType : uint8_t { kF32, kF64, kBF16, kI32, kI64 };
enum class Device : uint8_t { kCPU, kCUDA };

inline size_t dtype_size(DType t) {
  switch (t) {
    case DType::kF32:
      return 4;
    case DType::kF64:
      return 8;
    case DType::kBF16:
      return 2;
    case DType::kI32:
      return 4;
    case DType::kI64:
      return 8;
  }
  return 0;
}

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::kF32:
      return "f32";
    case DType::kF64:
      return "f64";
    case DType::kBF16:
      return "bf16";
    case DType::kI32:
      return "i32";
    case DType::kI64:
      return "i64";
  }
  return "?";
}

inline const char* device_name(Device d) { return d == Device::kCPU ? "cpu" : "cuda"; }

// bfloat16 storage with round-to-nearest-even conversion; arithmetic happens in float.
struct bf16 {
  uint16_t bits = 0;
  bf16() = default;
  explicit bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN stays NaN
      bits = static_cast<uint16_t>((u >> 16) | 0x40);
      return;
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    bits = static_cast<uint16_t>(u >> 16);
  }
  explicit operator float() const {
    uint32_t u = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};

}  // namespace hp
