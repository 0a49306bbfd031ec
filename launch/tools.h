// Data tools of the hotpath executable (`hotpath data ...`).
#pragma once

#include <string>
#include <vector>

namespace hp {

// `hotpath data synth --out FILE.{bin,h5} --docs N [--vocab_size V --seed S ...]`.
int data_tool_main(const std::vector<std::string>& args);

}  // namespace hp
