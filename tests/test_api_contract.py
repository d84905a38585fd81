"""The guide's "Python API Reference" and quick start, checked name by name: every function, class,
field and method it lists exists on cx / cx.distributed, the keyword names it uses are accepted, and
the defaults it documents (environment table, DDPConfig) are ours. And every code block of the guide
runs as written, on 2 ranks.

The lists are written out here (nothing is parsed at test time): when the seed changes, this
file changes with it.
"""
import numpy as np
import pytest

import ranks

import pycyxwiz as cx

D = cx.distributed

# ---- names -----------------------------------------------------------------------------

QUICK_START_TOP_LEVEL = ["SequentialModel", "LinearModule", "ReLUModule", "CrossEntropyLoss", "AdamOptimizer",
                         "distributed"]

DISTRIBUTED_FUNCTIONS = ["init", "finalize", "is_initialized", "get_rank", "get_world_size", "get_local_rank",
                         "is_master"]

DISTRIBUTED_CLASSES = ["DistributedConfig", "BackendType", "DDPConfig", "DistributedDataParallel",
                       "DistributedSampler", "DistributedBatchIterator", "DistributedTrainer",
                       "DistributedTrainingConfig", "DistributedTrainingHistory"]

METHODS = {
    "SequentialModel": ["add", "save"],
    "DistributedConfig": ["from_environment"],
    "DistributedDataParallel": ["forward", "backward", "sync_gradients", "update_parameters", "is_master",
                                "get_rank", "get_world_size", "get_model"],
    "DistributedSampler": ["set_epoch", "get_indices", "local_size", "total_size", "padded_size"],
    "DistributedBatchIterator": ["has_next", "next", "reset", "num_batches"],
    "DistributedTrainer": ["fit", "evaluate", "save_checkpoint", "load_checkpoint", "is_master", "get_rank",
                           "get_world_size"],
}

FIELDS = {
    "DistributedConfig": ["rank", "world_size", "local_rank", "master_addr", "master_port", "backend",
                          "timeout_ms"],
    "DDPConfig": ["broadcast_parameters", "bucket_size_mb", "find_unused_parameters"],
    "DistributedTrainingConfig": ["epochs", "batch_size", "shuffle", "seed", "verbose", "log_every_n_batches",
                                  "checkpoint_every_n_epochs", "checkpoint_dir", "save_on_master_only",
                                  "validation_split"],
    "DistributedTrainingHistory": ["train_losses", "train_accuracies", "val_losses", "val_accuracies",
                                   "total_time_seconds", "samples_per_second", "effective_batch_size",
                                   "world_size"],
}

# Values the seed assigns to each field in its examples: every one must be accepted as it is written.
SEED_ASSIGNMENTS = {
    "DistributedConfig": dict(rank=0, world_size=4, local_rank=0, master_addr="127.0.0.1", master_port=29500,
                              timeout_ms=30000),
    "DDPConfig": dict(broadcast_parameters=True, bucket_size_mb=25, find_unused_parameters=False),
    "DistributedTrainingConfig": dict(epochs=10, batch_size=64, shuffle=True, seed=42, verbose=True,
                                      log_every_n_batches=10, checkpoint_every_n_epochs=5,
                                      checkpoint_dir="./checkpoints", save_on_master_only=True,
                                      validation_split=0.1),
}


@pytest.mark.parametrize("name", QUICK_START_TOP_LEVEL)
def test_quick_start_names_are_on_cx(name):
    assert hasattr(cx, name), f"cx.{name} (seed 004 quick start) is missing"


@pytest.mark.parametrize("name", DISTRIBUTED_FUNCTIONS)
def test_distributed_functions_exist(name):
    assert callable(getattr(D, name, None)), f"cx.distributed.{name}() is missing"


@pytest.mark.parametrize("name", DISTRIBUTED_CLASSES)
def test_distributed_classes_exist(name):
    assert isinstance(getattr(D, name, None), type), f"cx.distributed.{name} is missing or not a class"


def test_every_name_is_exported_by_all():
    assert set(DISTRIBUTED_FUNCTIONS + DISTRIBUTED_CLASSES) <= set(D.__all__)
    assert set(QUICK_START_TOP_LEVEL) <= set(cx.__all__)


@pytest.mark.parametrize("cls,method", [(c, m) for c, ms in METHODS.items() for m in ms])
def test_methods_exist(cls, method):
    owner = getattr(cx, cls, None) or getattr(D, cls)
    assert callable(getattr(owner, method, None)), f"{cls}.{method}() is missing"


def instance(cls):
    return getattr(D, cls)()


@pytest.mark.parametrize("cls,field", [(c, f) for c, fs in FIELDS.items() for f in fs])
def test_fields_exist(cls, field):
    assert hasattr(instance(cls), field), f"{cls}.{field} is missing"


@pytest.mark.parametrize("cls", list(SEED_ASSIGNMENTS))
def test_fields_take_the_values_the_seed_assigns(cls):
    obj = instance(cls)
    for field, value in SEED_ASSIGNMENTS[cls].items():
        setattr(obj, field, value)
        assert getattr(obj, field) == value, (cls, field)
    obj = D.DistributedConfig()
    obj.backend = D.BackendType.NCCL
    obj.backend = D.BackendType.CPU
    assert obj.backend == D.BackendType.CPU


# ---- documented defaults ------------------------------------------------------------------

ENV_VARS = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "DISTRIBUTED_BACKEND",
            "DISTRIBUTED_TIMEOUT_MS", "DISTRIBUTED_OPERATION_TIMEOUT_MS", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
            "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"]


@pytest.fixture
def clean_env(monkeypatch):
    for v in ENV_VARS:
        monkeypatch.delenv(v, raising=False)
    return monkeypatch


def test_environment_defaults_are_the_seed_table(clean_env):
    clean_env.setenv("RANK", "3")
    clean_env.setenv("WORLD_SIZE", "4")
    c = D.DistributedConfig.from_environment()
    assert (c.rank, c.world_size) == (3, 4)
    assert c.local_rank == 3                                  # LOCAL_RANK: same as RANK
    assert c.master_addr == "127.0.0.1"                       # MASTER_ADDR
    assert c.master_port == 29500                             # MASTER_PORT
    assert c.backend == D.BackendType.CPU                     # DISTRIBUTED_BACKEND: cpu
    # DISTRIBUTED_TIMEOUT_MS, the "connection timeout": the guide's table says 30000, but nodes of a real
    # job start further apart than that; init() waits 10 minutes (Note [Two deadlines] in config.h).
    assert c.timeout_ms == 600000
    assert c.operation_timeout_ms == 1800000                  # DISTRIBUTED_OPERATION_TIMEOUT_MS


def test_environment_variables_of_the_seed_table_are_read(clean_env):
    for k, v in dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="10.0.0.7", MASTER_PORT="29611",
                     DISTRIBUTED_BACKEND="nccl", DISTRIBUTED_TIMEOUT_MS="1234").items():
        clean_env.setenv(k, v)
    c = D.DistributedConfig.from_environment()
    assert (c.rank, c.world_size, c.local_rank, c.master_addr, c.master_port, c.backend, c.timeout_ms) == \
        (1, 2, 0, "10.0.0.7", 29611, D.BackendType.NCCL, 1234)
    clean_env.setenv("DISTRIBUTED_BACKEND", "cpu")
    assert D.DistributedConfig.from_environment().backend == D.BackendType.CPU


def test_distributed_config_defaults_match_the_environment_table():
    c = D.DistributedConfig()
    assert (c.master_addr, c.master_port, c.backend, c.timeout_ms, c.operation_timeout_ms) == \
        ("127.0.0.1", 29500, D.BackendType.CPU, 600000, 1800000)


def test_ddp_config_defaults_are_the_seed_values():
    c = D.DDPConfig()
    assert c.broadcast_parameters is True
    assert c.bucket_size_mb == 25
    assert c.find_unused_parameters is False


# ---- the seed's calls, as written, on one rank ----------------------------------------------

def seed_calls(tmp):
    import os
    rng = np.random.default_rng(0)
    X = rng.standard_normal((96, 784)).astype(np.float32)
    y = rng.integers(0, 10, 96)
    out = {}
    out["state"] = (D.is_initialized(), D.get_rank(), D.get_world_size(), D.get_local_rank(), D.is_master())

    model = cx.SequentialModel()
    model.add(cx.LinearModule(784, 256))
    model.add(cx.ReLUModule())
    model.add(cx.LinearModule(256, 10))

    ddp_config = D.DDPConfig()
    ddp_config.broadcast_parameters = True
    ddp_config.bucket_size_mb = 25
    ddp_config.find_unused_parameters = False
    ddp = D.DistributedDataParallel(model, ddp_config)
    loss_fn = cx.CrossEntropyLoss()
    optimizer = cx.AdamOptimizer(0.001)
    output = ddp.forward(X[:8])
    loss_fn.forward(output, y[:8])
    grad_output = ddp.backward(loss_fn.backward())
    synced_grads = ddp.sync_gradients()
    ddp.update_parameters(optimizer)
    out["ddp"] = (grad_output.shape, synced_grads.shape, ddp.is_master(), ddp.get_rank(), ddp.get_world_size(),
                  ddp.get_model() is model)
    del ddp

    sampler = D.DistributedSampler(dataset_size=10000, shuffle=True, seed=42, drop_last=False)
    sampler.set_epoch(3)
    indices = sampler.get_indices()
    out["sampler"] = (len(indices), sampler.local_size(), sampler.total_size(), sampler.padded_size())
    batch_iter = D.DistributedBatchIterator(sampler, batch_size=64)
    n = 0
    while batch_iter.has_next():
        batch = batch_iter.next()
        n += 1
    batch_iter.reset(epoch=1)
    out["batches"] = (n, batch_iter.num_batches(), len(batch))
    D.DistributedSampler(dataset_size=len(X), drop_last=True)

    trainer = D.DistributedTrainer(model, cx.CrossEntropyLoss(), cx.AdamOptimizer(0.001))
    config = D.DistributedTrainingConfig()
    config.epochs = 2
    config.batch_size = 32
    config.shuffle = True
    config.seed = 42
    config.verbose = False
    config.log_every_n_batches = 10
    config.checkpoint_every_n_epochs = 5
    config.checkpoint_dir = os.path.join(tmp, "checkpoints")
    config.save_on_master_only = True
    config.validation_split = 0.1
    history = trainer.fit(X, y, config)
    history = trainer.fit(X[:64], y[:64], X[64:], y[64:], config)
    loss, accuracy = trainer.evaluate(X, y)
    trainer.save_checkpoint(os.path.join(tmp, "model.ckpt"))
    trainer.load_checkpoint(os.path.join(tmp, "model.ckpt"))
    if trainer.is_master():
        model.save(os.path.join(tmp, "model.cyxmodel"))
    out["trainer"] = (trainer.is_master(), trainer.get_rank(), trainer.get_world_size(), float(loss),
                      float(accuracy), os.path.exists(os.path.join(tmp, "model.cyxmodel")))
    out["history"] = (len(history.train_losses), len(history.train_accuracies), len(history.val_losses),
                      len(history.val_accuracies), history.total_time_seconds > 0,
                      history.samples_per_second > 0, history.effective_batch_size, history.world_size)
    return out


def test_the_seed_reference_calls_run_as_written_on_one_rank(tmp_path):
    (out,) = ranks.run(seed_calls, 1, args=(str(tmp_path),))
    assert out["state"] == (True, 0, 1, 0, True)
    assert out["ddp"] == ((8, 784), (784 * 256 + 256 + 256 * 10 + 10,), True, 0, 1, True)
    assert out["sampler"] == (10000, 10000, 10000, 10000)
    assert out["batches"] == (157, 157, 10000 - 156 * 64)
    master, rank, world, loss, acc, saved = out["trainer"]
    assert (master, rank, world, saved) == (True, 0, 1, True) and np.isfinite(loss) and 0 <= acc <= 1
    assert out["history"] == (2, 2, 2, 2, True, True, 32, 1)


@pytest.mark.parametrize("name", ["all_reduce", "broadcast", "all_gather", "reduce_scatter", "reduce", "scatter",
                                  "gather", "all_to_all", "barrier", "send", "recv"])
def test_every_collective_says_what_it_does_in_help(name):
    doc = getattr(D, name).__doc__
    # pybind11 puts the signature first; then our text: an example, the async form and the errors.
    text = doc.split("\n", 1)[1]
    assert f"cx.distributed.{name}(" in text, doc
    assert "async_op=True" in text and "Work" in text, doc
    assert "DistributedConnectionError" in text and "DistributedTimeoutError" in text, doc


# ---- every code block of the guide, as written, on 2 ranks ----------------------------------------
# Copied verbatim from the guide. Where it elides with `...` (trainer.fit(...), loss_fn.backward(...))
# the elision is filled in, and ELISIONS lists each fill; PRELUDE defines the names a block uses but
# leaves to the reader (data, a model, an epoch number). The init block is two programs: from the
# environment, and with an explicit config (the guide's config says rank 0 of 4: every process runs it
# with its own rank).

GUIDE_BLOCKS = {
    "quick_start": '''
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
''',
    "init_from_environment": '''
import pycyxwiz as cx

# Initialize from environment variables
cx.distributed.init()

# Query state
cx.distributed.is_initialized()  # -> bool
cx.distributed.get_rank()        # -> int
cx.distributed.get_world_size()  # -> int
cx.distributed.get_local_rank()  # -> int
cx.distributed.is_master()       # -> bool (True if rank == 0)

# Cleanup
cx.distributed.finalize()
''',
    "init_with_config": '''
import pycyxwiz as cx

# Initialize with explicit config
config = cx.distributed.DistributedConfig()
config.rank = 0
config.world_size = 4
cx.distributed.init(config)

# Query state
cx.distributed.is_initialized()  # -> bool
cx.distributed.get_rank()        # -> int
cx.distributed.get_world_size()  # -> int
cx.distributed.get_local_rank()  # -> int
cx.distributed.is_master()       # -> bool (True if rank == 0)

# Cleanup
cx.distributed.finalize()
''',
    "distributed_config": '''
config = cx.distributed.DistributedConfig()
config.rank = 0                    # Global rank
config.world_size = 4              # Total processes
config.local_rank = 0              # GPU index on this machine
config.master_addr = "127.0.0.1"   # IP of rank 0
config.master_port = 29500         # Communication port
config.backend = cx.distributed.BackendType.CPU  # or NCCL
config.timeout_ms = 30000          # Connection timeout

# Create from environment
config = cx.distributed.DistributedConfig.from_environment()
''',
    "ddp": '''
# Configuration
ddp_config = cx.distributed.DDPConfig()
ddp_config.broadcast_parameters = True   # Sync params from rank 0
ddp_config.bucket_size_mb = 25           # Gradient bucket size
ddp_config.find_unused_parameters = False

# Wrap model
ddp = cx.distributed.DistributedDataParallel(model, ddp_config)

# Training methods
output = ddp.forward(input_tensor)
grad_output = ddp.backward(grad_tensor)
synced_grads = ddp.sync_gradients()      # AllReduce gradients
ddp.update_parameters(optimizer)          # Sync + update

# Info methods
ddp.is_master()       # -> bool
ddp.get_rank()        # -> int
ddp.get_world_size()  # -> int
ddp.get_model()       # -> SequentialModel
''',
    "sampler_and_iterator": '''
# Create sampler
sampler = cx.distributed.DistributedSampler(
    dataset_size=10000,
    shuffle=True,
    seed=42,
    drop_last=False
)

# Per-epoch methods
sampler.set_epoch(epoch)     # IMPORTANT: call at start of each epoch
indices = sampler.get_indices()  # Get this rank's indices

# Info methods
sampler.local_size()    # Samples for this rank
sampler.total_size()    # Total dataset size
sampler.padded_size()   # Padded size (divisible by world_size)

# Create iterator
batch_iter = cx.distributed.DistributedBatchIterator(sampler, batch_size=64)

# Iterate
while batch_iter.has_next():
    indices = batch_iter.next()  # -> list of indices
    # Use indices to get batch from dataset

# Reset for new epoch
batch_iter.reset(epoch=1)

# Info
batch_iter.num_batches()  # Total batches per epoch
''',
    "trainer_and_history": '''
# Create trainer
trainer = cx.distributed.DistributedTrainer(model, loss_fn, optimizer)

# Configure
config = cx.distributed.DistributedTrainingConfig()
config.epochs = 10
config.batch_size = 64              # Per-GPU
config.shuffle = True
config.seed = 42
config.verbose = True
config.log_every_n_batches = 10
config.checkpoint_every_n_epochs = 5
config.checkpoint_dir = "./checkpoints"
config.save_on_master_only = True
config.validation_split = 0.1

# Train
history = trainer.fit(X_train, y_train, config)
# Or with validation data:
history = trainer.fit(X_train, y_train, X_val, y_val, config)

# Evaluate
loss, accuracy = trainer.evaluate(X_test, y_test)

# Checkpointing
trainer.save_checkpoint("model.ckpt")
trainer.load_checkpoint("model.ckpt")

# Info
trainer.is_master()
trainer.get_rank()
trainer.get_world_size()

history = trainer.fit(...)

history.train_losses        # List[float] - per epoch
history.train_accuracies    # List[float] - per epoch
history.val_losses          # List[float] - per epoch
history.val_accuracies      # List[float] - per epoch
history.total_time_seconds  # float
history.samples_per_second  # float - throughput
history.effective_batch_size  # int - batch_size * world_size
history.world_size          # int
''',
    "backends": '''
# CPU Backend (works everywhere)
config.backend = cx.distributed.BackendType.CPU

# NCCL Backend (Linux + NVIDIA GPUs, fastest)
config.backend = cx.distributed.BackendType.NCCL
''',
    "best_practices": '''
for epoch in range(num_epochs):
    sampler.set_epoch(epoch)  # Ensures different shuffling each epoch
    # ... training loop

if trainer.is_master():
    print(f"Epoch {epoch}: Loss = {loss}")
    model.save("checkpoint.ckpt")

# Linear scaling rule
base_lr = 0.001
base_batch_size = 64
effective_batch_size = batch_size * world_size
scaled_lr = base_lr * (effective_batch_size / base_batch_size)

accumulation_steps = 4
for i, batch in enumerate(batches):
    output = ddp.forward(batch)
    loss = loss_fn.forward(output, target) / accumulation_steps
    ddp.backward(loss_fn.backward(...))

    if (i + 1) % accumulation_steps == 0:
        ddp.sync_gradients()
        ddp.update_parameters(optimizer)

# Use drop_last=True for consistent batch sizes
sampler = cx.distributed.DistributedSampler(
    dataset_size=len(dataset),
    drop_last=True  # Ensures all ranks have same number of batches
)
''',
}

# The guide's `...` elisions, filled in (block, as written, as run).
ELISIONS = [
    ("trainer_and_history", "history = trainer.fit(...)", "history = trainer.fit(X_train, y_train, config)"),
    ("best_practices", "ddp.backward(loss_fn.backward(...))", "ddp.backward(loss_fn.backward(1 / accumulation_steps))"),
]

PRELUDE = '''
import numpy as np
import pycyxwiz as cx
_rng = np.random.default_rng(0)
X_train = _rng.standard_normal((256, 784)).astype(np.float32)
y_train = _rng.integers(0, 10, 256)
X_val, y_val = X_train[:64], y_train[:64]
X_test, y_test = X_train[64:128], y_train[64:128]
cx.manual_seed(0)
model = cx.SequentialModel()
model.add(cx.LinearModule(784, 32)); model.add(cx.ReLUModule()); model.add(cx.LinearModule(32, 10))
loss_fn = cx.CrossEntropyLoss()
optimizer = cx.AdamOptimizer(0.001)
input_tensor = X_train[:8]
grad_tensor = np.full((8, 10), 0.01, np.float32)
epoch, num_epochs, loss = 0, 2, 0.5
batch_size, world_size = 64, cx.distributed.get_world_size() if cx.distributed.is_initialized() else 1
target = y_train[:8]
batches = [X_train[8 * i:8 * (i + 1)] for i in range(8)]
dataset = list(range(100))
'''


def guide_block(name, folder, port):
    import os
    os.chdir(folder)
    code = GUIDE_BLOCKS[name]
    for block, written, run in ELISIONS:
        if block == name:
            assert written in code
            code = code.replace(written, run)
    if name == "init_with_config":
        # The guide's rank-0 process; the others are the same program with their own rank. The port is
        # the test's (the guide's config leaves it at 29500, which another test may hold).
        code = code.replace("config.rank = 0", f"config.rank = {int(os.environ['RANK'])}")
        real = D.DistributedConfig

        def config_on_this_port():
            c = real()
            c.master_port = port
            return c
        config_on_this_port.from_environment = real.from_environment
        D.DistributedConfig = config_on_this_port
    ns = {}
    exec(PRELUDE, ns)
    if name == "backends":
        ns["config"] = D.DistributedConfig()
    if name == "best_practices":
        exec("trainer = cx.distributed.DistributedTrainer(model, loss_fn, optimizer)\n"
             "sampler = cx.distributed.DistributedSampler(dataset_size=256)\n"
             "ddp = cx.distributed.DistributedDataParallel(model)", ns)
    exec(code, ns)
    keep = {}
    for k in ("history", "synced_grads", "indices", "loss", "accuracy", "scaled_lr", "config"):
        v = ns.get(k)
        if v is not None:
            keep[k] = v if isinstance(v, (int, float, list, np.ndarray)) else repr(v)
    if "model" in ns:
        keep["params"] = ns["model"].flat_parameters().copy()
    return keep


@pytest.mark.parametrize("name", [n for n in GUIDE_BLOCKS if n not in ("quick_start", "init_from_environment",
                                                                       "init_with_config")])
def test_the_guides_code_blocks_run_as_written_on_two_ranks(tmp_path, name):
    outs = ranks.run(guide_block, 2, args=(name, str(tmp_path), 0), timeout=120)
    if name in ("ddp", "trainer_and_history", "best_practices"):
        np.testing.assert_array_equal(outs[0]["params"], outs[1]["params"])  # one model on both ranks
    if name == "ddp":
        assert np.any(outs[0]["synced_grads"]) and np.array_equal(outs[0]["synced_grads"], outs[1]["synced_grads"])
    if name == "trainer_and_history":
        assert "epochs=10" in outs[0]["history"] and 0 <= outs[0]["accuracy"] <= 1
        assert (tmp_path / "model.ckpt").exists() and (tmp_path / "checkpoints" / "epoch_0010.ckpt").exists()
    if name == "sampler_and_iterator":
        assert len(outs[0]["indices"]) == 64 or len(outs[0]["indices"]) == 5000 % 64
    if name == "best_practices":
        assert outs[0]["scaled_lr"] == pytest.approx(0.002) and (tmp_path / "checkpoint.ckpt").exists()


def test_the_guides_two_ways_to_init_run_as_written(tmp_path):
    outs = ranks.run(guide_block, 2, args=("quick_start", str(tmp_path), 0), init=False, timeout=120)
    assert (tmp_path / "model.cyxmodel").exists()
    np.testing.assert_array_equal(outs[0]["params"], outs[1]["params"])
    ranks.run(guide_block, 2, args=("init_from_environment", str(tmp_path), 0), init=False, timeout=60)
    port = ranks.free_port()
    ranks.run(guide_block, 4, args=("init_with_config", str(tmp_path), port), init=False, timeout=60)
