"""Writes the JSON config that the TorchNeuron stand-in (`torch_neuronx` in this folder) reads.

The stand-in runs on the reference device's compiled extension but must not import
`optimum_neuron_torch` (torch autoloads it during `import torch`, before the library). So a process
where the library activated the reference device writes down what the stand-in needs: the path of
the built extension and the op lists of the `torchneuron` support profile.

    python tests/torchneuron_standin/make_config.py /tmp/standin.json
"""

from __future__ import annotations

import json
import os
import sys


def write_config(path: str | os.PathLike[str]) -> dict:
    """Writes the config to `path` and returns it. Call it where `import optimum_neuron_torch`
    activated the reference device (not the stand-in: its extension path would be missing)."""
    import optimum_neuron_torch  # noqa: F401  (activates the device backend)
    from optimum_neuron_torch.device import reference
    from optimum_neuron_torch.device.reference.profiles import (
        DEVICE_ONLY_OPS,
        VIEW_OPS,
        load_profile,
    )

    profile = load_profile("torchneuron")
    config = {
        "extension": reference.state().extension.__file__,
        "native_ops": sorted(profile.native_ops | VIEW_OPS),
        "route_ops": sorted(profile.native_ops | DEVICE_ONLY_OPS),
    }
    tmp = f"{os.fspath(path)}.{os.getpid()}.tmp"
    with open(tmp, "w") as file:
        json.dump(config, file, indent=1)
    os.replace(tmp, path)  # concurrent test workers never read a half-written file
    return config


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} CONFIG.json")
    # Run as a script, this folder is first on sys.path, where torch would find the stand-in's
    # dist-info and autoload it at `import torch`, before it has its config: take it off first.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != here]
    written = write_config(sys.argv[1])
    print(f"{sys.argv[1]}: extension {written['extension']}, {len(written['native_ops'])} native ops")
