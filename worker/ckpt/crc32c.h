// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78, init and final xor
// 0xFFFFFFFF) — the checksum of checkpoint blocks (README.md). Software
// table-driven: checkpoint I/O is bound by the disk, not by this.
//
// Thread-safe: pure functions over a constant table.
#ifndef HSDP_WORKER_CKPT_CRC32C_H_
#define HSDP_WORKER_CKPT_CRC32C_H_

#include <cstddef>
#include <cstdint>

namespace hsdp::ckpt {

// Continues `crc` (the value returned for the bytes before; 0 to start) over
// `size` bytes at `data`.
uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t size);

inline uint32_t Crc32c(const void* data, size_t size) {
  return Crc32cExtend(0, data, size);
}

}  // namespace hsdp::ckpt

#endif  // HSDP_WORKER_CKPT_CRC32C_H_
