# lowprec dump: Sequential_0, dynamo graph after pass 1 of 1: insert_quantize
# GraphModule.code of the FX graph. Run: GraphModule().forward(*inputs), the inputs as
# manifest.json lists them under graphs["dynamo"]["inputs"].
import torch
from torch import device  # noqa: F401
from math import inf, nan  # noqa: F401
import lpcompile  # noqa: F401  (defines the torch.ops.lowprec operators)


class GraphModule(torch.nn.Module):
    def forward(self, L_fn_modules_0_parameters_weight_ : torch.nn.parameter.Parameter, L_fn_modules_0_parameters_bias_ : torch.nn.parameter.Parameter, L_args_0_ : torch.Tensor, L_fn_modules_2_parameters_weight_ : torch.nn.parameter.Parameter, L_fn_modules_2_parameters_bias_ : torch.nn.parameter.Parameter, lowprec_seed):
        l_fn_modules_0_parameters_weight_ = L_fn_modules_0_parameters_weight_
        l_fn_modules_0_parameters_bias_ = L_fn_modules_0_parameters_bias_
        l_args_0_ = L_args_0_
        l_fn_modules_2_parameters_weight_ = L_fn_modules_2_parameters_weight_
        l_fn_modules_2_parameters_bias_ = L_fn_modules_2_parameters_bias_
        quantize_default = torch.ops.lowprec.quantize.default(l_args_0_, 'e5m2', 'nearest', 'saturate', None, 1382219776, None);  l_args_0_ = None
        quantize_grad_default = torch.ops.lowprec.quantize_grad.default(l_fn_modules_0_parameters_weight_, 'e5m2', 'stochastic', 'inf', lowprec_seed, 1382219777);  l_fn_modules_0_parameters_weight_ = None
        quantize_default_1 = torch.ops.lowprec.quantize.default(quantize_grad_default, 'e5m2', 'nearest', 'saturate', None, 1382219778, None);  quantize_grad_default = None
        input_1 = torch._C._nn.linear(quantize_default, quantize_default_1, l_fn_modules_0_parameters_bias_);  quantize_default = quantize_default_1 = l_fn_modules_0_parameters_bias_ = None
        quantize_grad_default_1 = torch.ops.lowprec.quantize_grad.default(input_1, 'e5m2', 'stochastic', 'inf', lowprec_seed, 1382219779);  input_1 = None
        input_2 = torch.nn.functional.relu(quantize_grad_default_1, inplace = False);  quantize_grad_default_1 = None
        quantize_default_2 = torch.ops.lowprec.quantize.default(input_2, 'e5m2', 'nearest', 'saturate', None, 1382219780, None);  input_2 = None
        quantize_grad_default_2 = torch.ops.lowprec.quantize_grad.default(l_fn_modules_2_parameters_weight_, 'e5m2', 'stochastic', 'inf', lowprec_seed, 1382219781);  l_fn_modules_2_parameters_weight_ = None
        quantize_default_3 = torch.ops.lowprec.quantize.default(quantize_grad_default_2, 'e5m2', 'nearest', 'saturate', None, 1382219782, None);  quantize_grad_default_2 = None
        input_3 = torch._C._nn.linear(quantize_default_2, quantize_default_3, l_fn_modules_2_parameters_bias_);  quantize_default_2 = quantize_default_3 = l_fn_modules_2_parameters_bias_ = None
        quantize_grad_default_3 = torch.ops.lowprec.quantize_grad.default(input_3, 'e5m2', 'stochastic', 'inf', lowprec_seed, 1382219783);  input_3 = lowprec_seed = None
        return (quantize_grad_default_3,)
