# Sourced by the device-machine scripts: the carried wheels (.whl, scripts/fetch_gpu_wheels.sh) into
# /tmp/site, this checkout on PYTHONPATH, and the NCCL settings the device machine asks for.
# FORK_DIR (a carried directory holding another version's zero3_ac package) goes before the checkout.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
# The installed package's zero3_ac.pth applies the fork in every process; PYTHONPATH entries do not
# read .pth files, so a sitecustomize does the same here (ZERO3_AC_DISABLE=1 keeps a process stock).
echo "import _zero3_ac_autoload" >/tmp/site/sitecustomize.py
export PYTHONPATH=/tmp/site:${FORK_DIR:+$(cd "$FORK_DIR" && pwd):}$PWD

# readme_header TITLE FILE: FILE starts with TITLE, the machine, the versions and the "Commands" heading.
readme_header() {
    {
        echo "# $1"
        echo
        echo "$(date -u), $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader)"
        echo
        python3 -c 'import torch, transformers, peft, deepspeed, zero3_ac; print("torch", torch.__version__, "transformers", transformers.__version__, "peft", peft.__version__, "deepspeed", deepspeed.__version__, "fork active", zero3_ac.is_active())'
        echo
        echo "Commands (from the repository root; the carried wheels installed by \`source benchmarks/gpu_site.sh\`):"
        echo
    } >"$2" 2>&1
}
