export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/gguf-*.whl
python3 -c "
import torch, tests.test_async_draft as t
t.test_async_drafting_on_a_gpu_stream(); print('GPU stream test passed')" 2>&1 | tail -12
