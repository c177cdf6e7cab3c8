// Checks on hsdp.v1.TrainingSpec, the training settings every worker of a job
// shares.
#ifndef HSDP_COMMON_TRAINING_SPEC_H_
#define HSDP_COMMON_TRAINING_SPEC_H_

#include <string>

#include "absl/status/status.h"
#include "hsdp/v1/common.pb.h"

namespace hsdp {

// OK when `got` equals `want` field by field. Otherwise FAILED_PRECONDITION
// naming the first differing field with both values, e.g. "training setting
// optimizer.lr differs: this worker has 0.001, the job has 0.003".
absl::Status CompareTrainingSpecs(const hsdp::v1::TrainingSpec& got,
                                  const hsdp::v1::TrainingSpec& want);

// The same, with the sides named `got_label` and `want_label` in the message
// instead of "this worker" and "the job" (e.g. "the run", "the reference").
absl::Status CompareTrainingSpecs(const hsdp::v1::TrainingSpec& got,
                                  const hsdp::v1::TrainingSpec& want,
                                  const std::string& got_label,
                                  const std::string& want_label);

// One line per set field ("optimizer.lr: 0.003"), for status displays.
std::string DescribeTrainingSpec(const hsdp::v1::TrainingSpec& spec);

}  // namespace hsdp

#endif  // HSDP_COMMON_TRAINING_SPEC_H_
