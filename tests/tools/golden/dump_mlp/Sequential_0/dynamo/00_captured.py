# lowprec dump: Sequential_0, dynamo graph as captured
# GraphModule.code of the FX graph. Run: GraphModule().forward(*inputs), the inputs as
# manifest.json lists them under graphs["dynamo"]["inputs"].
import torch
from torch import device  # noqa: F401
from math import inf, nan  # noqa: F401
import lpcompile  # noqa: F401  (defines the torch.ops.lowprec operators)


class GraphModule(torch.nn.Module):
    def forward(self, L_fn_modules_0_parameters_weight_ : torch.nn.parameter.Parameter, L_fn_modules_0_parameters_bias_ : torch.nn.parameter.Parameter, L_args_0_ : torch.Tensor, L_fn_modules_2_parameters_weight_ : torch.nn.parameter.Parameter, L_fn_modules_2_parameters_bias_ : torch.nn.parameter.Parameter):
        l_fn_modules_0_parameters_weight_ = L_fn_modules_0_parameters_weight_
        l_fn_modules_0_parameters_bias_ = L_fn_modules_0_parameters_bias_
        l_args_0_ = L_args_0_
        l_fn_modules_2_parameters_weight_ = L_fn_modules_2_parameters_weight_
        l_fn_modules_2_parameters_bias_ = L_fn_modules_2_parameters_bias_
        input_1 = torch._C._nn.linear(l_args_0_, l_fn_modules_0_parameters_weight_, l_fn_modules_0_parameters_bias_);  l_args_0_ = l_fn_modules_0_parameters_weight_ = l_fn_modules_0_parameters_bias_ = None
        input_2 = torch.nn.functional.relu(input_1, inplace = False);  input_1 = None
        input_3 = torch._C._nn.linear(input_2, l_fn_modules_2_parameters_weight_, l_fn_modules_2_parameters_bias_);  input_2 = l_fn_modules_2_parameters_weight_ = l_fn_modules_2_parameters_bias_ = None
        return (input_3,)
