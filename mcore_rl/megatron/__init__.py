"""mcore-rl: Megatron-Core integration (process groups, CPU backend, model, conversion).

Megatron-Core warns at import time that optional fused kernels (Apex, Transformer Engine) are
absent and that it falls back to its own implementations; on a CPU, or a GPU image without
them, that fallback is the intended path, so those notices are silenced here (one filter per
notice, nothing broader).
"""

import warnings

for _pattern in (
    r"(Transformer Engine and )?Apex (is|are) not installed",
    r"Transformer Engine and Apex are not installed",
    r"full scope is deprecated",
):
    warnings.filterwarnings("ignore", message=_pattern, category=UserWarning)
