#!/bin/sh
# Print the image's lock (docker/requirements.txt) for a torch variant:
#   cuda  PyPI's torch, which carries the CUDA libraries (one image for CPU and GPU hosts): the lock as is
#   cpu   torch and torchvision pinned to PyTorch's "+cpu" builds of the same versions, which live on
#         PyTorch's CPU wheel index (https://download.pytorch.org/whl/cpu), not on PyPI
#
#   docker/torch-variant.sh cpu docker/requirements.txt > requirements-cpu.txt
#
# Used by the Dockerfile (build argument TORCH_VARIANT) and by docker/build.sh's wheelhouse, so both
# install the same thing. POSIX sh: it runs in the image's build stage.
set -eu
if [ $# -ne 2 ]; then
    echo "usage: $0 cuda|cpu REQUIREMENTS" >&2
    exit 2
fi
case "$1" in
    cuda) cat "$2" ;;
    cpu)
        out="$(sed -E 's/^(torch|torchvision)==([^+]+)$/\1==\2+cpu/' "$2")"
        if [ "$(printf '%s\n' "$out" | grep -cE '^(torch|torchvision)==[^+]+\+cpu$')" -ne 2 ]; then
            echo "$2 must pin torch and torchvision (torch==X, torchvision==Y) for the cpu variant" >&2
            exit 1
        fi
        printf '%s\n' "$out"
        ;;
    *)
        echo "TORCH_VARIANT must be cuda or cpu, got '$1'" >&2
        exit 2
        ;;
esac
