"""Seed 004's "Python API Reference" and quick start, checked name by name: every function,
class, field and method it lists exists on cx / cx.distributed, the keyword names it uses are
accepted, and the defaults it documents (environment table, DDPConfig) are ours.

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
