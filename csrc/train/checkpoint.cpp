#include "train/checkpoint.h"

#include <cstring>

#include "common/error.h"

namespace cx::train {

void load_model_state(nn::SequentialModel& model, const std::string& cyxmodel, const std::string& what) {
  auto src = nn::SequentialModel::deserialize(cyxmodel, what);
  CX_CHECK(src->size() == model.size() && src->num_parameters() == model.num_parameters() &&
               src->param_slices() == model.param_slices(),
           InvalidArgument, "load_checkpoint: ", what, " holds a model with ", src->size(), " layers and ",
           src->num_parameters(), " parameters, but this trainer's model has ", model.size(), " layers and ",
           model.num_parameters(), " parameters; build the same architecture before loading");
  for (size_t i = 0; i < model.size(); ++i)
    CX_CHECK(src->module(i)->type_name() == model.module(i)->type_name(), InvalidArgument, "load_checkpoint: ",
             what, " has ", src->module(i)->type_name(), " at layer ", i, " where this model has ",
             model.module(i)->type_name());
  std::memcpy(model.flat_params(), src->flat_params(), model.num_parameters() * sizeof(float));
  for (size_t i = 0; i < model.size(); ++i) {
    auto dst_b = model.module(i)->buffers();
    auto src_b = src->module(i)->buffers();
    for (size_t k = 0; k < dst_b.size() && k < src_b.size(); ++k) *dst_b[k] = *src_b[k];
  }
}

}  // namespace cx::train
