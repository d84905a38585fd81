"""The distributed training guide's quick start, runnable: the lines between the markers are
the guide's, unchanged.

    python examples/quickstart.py                          # one process
    ./launch_distributed.sh 4 python examples/quickstart.py

The guide leaves X_train/y_train undefined; here they are 784-feature inputs built from
the digits set (8x8 images upscaled to 28x28, like MNIST) so the guide's 784-256-10 MLP fits.
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _data import load_digits  # noqa: E402

_X, _y = load_digits()
X_train = np.ascontiguousarray(np.kron(_X.reshape(-1, 8, 8), np.ones((4, 4), np.float32))[:, 2:30, 2:30]
                               .reshape(-1, 784))
y_train = _y

# ---- the guide's "Quick Start", step 2 ----
import pycyxwiz as cx

# Initialize distributed
cx.distributed.init()

# Create model
model = cx.SequentialModel()
model.add(cx.LinearModule(784, 256))
model.add(cx.ReLUModule())
model.add(cx.LinearModule(256, 10))

# Create trainer
trainer = cx.distributed.DistributedTrainer(
    model,
    cx.CrossEntropyLoss(),
    cx.AdamOptimizer(0.001)
)

# Configure and train
config = cx.distributed.DistributedTrainingConfig()
config.epochs = 10
config.batch_size = 64  # Per-GPU batch size

history = trainer.fit(X_train, y_train, config)

# Save model (master only)
if trainer.is_master():
    model.save("model.cyxmodel")

cx.distributed.finalize()
# ---- end of the guide's lines ----
if trainer.is_master():
    print(f"final training accuracy {history.train_accuracies[-1]:.4f} on {history.world_size} rank(s); "
          f"saved model.cyxmodel")
