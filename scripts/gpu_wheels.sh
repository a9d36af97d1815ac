#!/usr/bin/env bash
# Download the wheels the GPU suite needs on a bare GPU machine (python 3.12, x86-64, torch + CUDA
# already there, no package index) into .whl/ (or $1), then check that every requirement of every
# wheel is either downloaded too or already on that machine's image. The versions are the ones this
# project is tested with. Keep .whl/ out of git (.git/info/exclude: /.whl/).
#
#   scripts/gpu_wheels.sh            # then see benchmarks/README.md, "The GPU suite"
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.whl}
py=${PYTHON:-python3}
wheels=(
  monai==1.6.1 pytorch-ignite==0.5.5 nibabel==5.4.2 nvtx==0.2.17 nvidia-ml-py==13.615.71 tqdm==4.70.1
  fsspec==2026.9.0 tensorboard==2.21.0 tifffile==2026.3.3
)
# what the image of the GPU machines already holds (/work/.library/device/KINDS.md), and torch itself
image=(torch numpy packaging typing-extensions importlib-resources absl-py grpcio markdown protobuf setuptools
  tensorboard-data-server werkzeug six pillow psutil matplotlib pyyaml filelock jinja2 sympy networkx)
present=" ${image[*]} "
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
mkdir -p "$dest"
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
  -d "$dest" "${wheels[@]}"
missing=0
for w in "$dest"/*.whl; do
  name=$(basename "$w" | cut -d- -f1 | tr '_A-Z' '-a-z')
  while read -r req; do
    dep=$(echo "$req" | sed -E 's/^Requires-Dist: *([A-Za-z0-9_.-]+).*/\1/' | tr '_A-Z.' '-a-z-')
    have=no
    for f in "$dest"/*.whl; do
      [ "$(basename "$f" | cut -d- -f1 | tr '_A-Z.' '-a-z-')" = "$dep" ] && have=yes
    done
    case "$present" in *" $dep "*) have=yes ;; esac
    if [ "$have" = no ]; then
      echo "MISSING: $name needs $req" >&2
      missing=1
    fi
  done < <(unzip -p "$w" '*.dist-info/METADATA' | grep '^Requires-Dist' | grep -v 'extra ==' \
           | grep -v -e 'python_version < "3.1[0-2]"' -e 'platform_system == "Windows"' || true)
done
ls -1 "$dest"
du -sh "$dest"
[ "$missing" = 0 ] && echo "every requirement is in $dest or on the GPU image" || exit 1
