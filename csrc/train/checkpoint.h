// defines: load_model_state, the C++ half of DistributedTrainer.load_checkpoint: it puts a checkpoint's model
// (.cyxmodel bytes) into the trainer's model. The checkpoint file itself (format, optimizer state, generator
// states, position) is written and read in python/pycyxwiz/distributed/_train.py.
#pragma once

#include <string>

#include "nn/sequential.h"

namespace cx::train {

// Copies the parameters and module buffers (BatchNorm statistics) of the model in `cyxmodel` into `model`, which
// must have the same architecture: same layers in the same order, same parameter layout. Otherwise
// InvalidArgument, saying what differs; a damaged `cyxmodel` raises IoError. `what` names the source in messages
// (the checkpoint's path).
void load_model_state(nn::SequentialModel& model, const std::string& cyxmodel, const std::string& what);

}  // namespace cx::train
