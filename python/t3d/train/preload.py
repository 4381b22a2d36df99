"""What t3d-train's fork server imports once (cli._launch_forks): the modules every rank of a CPU run needs before
its first step, so that each rank, a fork of the server, starts with them loaded. A module that fails to import
here is left to the rank, which imports it (and reports the failure) itself."""

import importlib

from .loop import set_offline_env

set_offline_env()  # before transformers and datasets are imported

for _name in ("torch.distributed.tensor", "torch.distributed.fsdp", "torch.distributed.checkpoint", "transformers",
              "transformers.modeling_utils", "transformers.models.llama.modeling_llama", "datasets", "t3d", "t3d.hf",
              "t3d.cp"):
    try:
        importlib.import_module(_name)
    except Exception:  # noqa: BLE001
        pass
