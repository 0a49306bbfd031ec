// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), the checksum of checkpoint data chunks.
// Uses the SSE4.2 crc32 instruction where the CPU has it, a table otherwise; both give the same
// value. crc32c("123456789") == 0xE3069283.
// Thread safety: pure functions.
#pragma once

#include <cstddef>
#include <cstdint>

namespace hp {

// CRC-32C of `n` bytes at `data`, continuing from `crc` (0 for a fresh checksum).
uint32_t crc32c(const void* data, size_t n, uint32_t crc = 0);

// The table-driven version alone (for tests comparing the two paths).
uint32_t crc32c_portable(const void* data, size_t n, uint32_t crc = 0);

}  // namespace hp
