"""pytest marks of the GPU tests of the Gluon kernels (kernels/*_wgmma.py): they run on Hopper only."""
import pytest
import torch

MARKS = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
         pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] != 9,
                            reason="the Gluon kernels are for compute capability 9.x")]
