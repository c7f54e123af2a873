#!/usr/bin/env bash
# The wheels the GPU jobs need that the device image lacks, into .whl/ (git-ignored; name it in
# the device call's carry). Run here, in the repo root, where pip reaches an index:
#   bash scripts/fetch_device_wheels.sh [DIR]
# The image has torch, transformers, pandas, pyarrow, accelerate, sacrebleu, scikit-learn,
# jinja2, tiktoken, tokenizers (KINDS.md); it lacks lm-eval 0.4.13 and the rest of its needs below,
# nakta-serve's FastAPI + uvicorn, fairscale
# (llama_org; sdist only, so built here) and liger-kernel (a kernel benchmark peer). pytz is
# imported by lm-eval's results table (pytablewriter -> typepy) after the evaluation: without
# it every lm-eval child writes its results and then exits 1.
set -euo pipefail
DIR=${1:-.whl}
mkdir -p "$DIR"
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64
  --platform any)
BINARY=(  # name==version: the versions this repo's CPU environment runs
  lm_eval==0.4.13 datasets==5.2.0 evaluate==0.4.6 pytablewriter==1.2.1 DataProperty==1.1.1
  mbstrdecoder==1.1.5 pathvalidate==3.3.1 tabledata==1.3.5 tcolorpy==0.1.7 typepy==1.3.5
  chardet==6.0.0.post1 dill==0.4.1 more-itertools==11.2.1 multiprocess==0.70.19 nltk==3.10.4
  pytz==2026.6 liger-kernel==0.8.5
  # nakta-serve's ASGI stack (the image has anyio, h11, httpx, click, prometheus-client):
  # pydantic pinned to the core it was built against
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 opentelemetry-api==1.45.2
  pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.5
  httptools==0.9.0 uvloop==0.23.0  # uvicorn's C HTTP parser and event loop, used when present
  # the OpenAI client the serve tests talk through (tests/test_serve_tp.py on two GPUs)
  openai==3.57.0 jiter==0.19.0 sniffio==1.3.1 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5
)
SDIST_ONLY=(sqlitedict==2.1.0 word2number==1.1 rouge_score==0.1.2 fairscale==0.4.13)
for spec in "${BINARY[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${PLATFORMS[@]}" -d "$DIR" "$spec"
done
python3 -m pip wheel -q --no-deps -w "$DIR" "${SDIST_ONLY[@]}"
ls "$DIR"/*.whl | wc -l | xargs echo "wheels in $DIR:"
du -sh "$DIR"
