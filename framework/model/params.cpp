#include "framework/model/params.h"

#include <cstdlib>

namespace hp {

int param_layer(const std::string& name) {
  const std::string pre = "layers.";
  if (name.compare(0, pre.size(), pre) != 0) return -1;
  return std::atoi(name.c_str() + pre.size());
}

Param& ParamRegistry::add(Param p) {
  HP_CHECK(find(p.name) == nullptr, "parameter ", p.name, " registered twice");
  params_.push_back(std::make_unique<Param>(std::move(p)));
  return *params_.back();
}

Param& ParamRegistry::get(const std::string& name) {
  for (auto& p : params_)
    if (p->name == name) return *p;
  HP_FAIL(ErrorKind::kInternal, "no parameter named ", name);
}

const Param* ParamRegistry::find(const std::string& name) const {
  for (auto& p : params_)
    if (p->name == name) return p.get();
  return nullptr;
}

}  // namespace hp
