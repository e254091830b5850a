"""The command line's arguments: the one parser of --shapes and --m (jaxfp8/tools/args.py)."""

from __future__ import annotations

import pytest

from jaxfp8.tools import args


# ---- the shapes parser -----------------------------------------------------------------------------------------------

def test_shapes_in_both_forms():
  assert args.parse_shapes("24576,7168; 576,7168") == [("24576x7168", 24576, 7168, None), ("576x7168", 576, 7168, None)]
  # M,N,K: the Ms of one weight collected, in order of appearance.
  assert args.parse_shapes("64,24576,7168;4096,24576,7168;1,576,7168") == [
      ("24576x7168", 24576, 7168, (64, 4096)), ("576x7168", 576, 7168, (1,))]
  assert args.parse_shapes("1x256x512") == [("256x512", 256, 512, (1,))]
  assert args.parse_ms("1,16,64,16") == (1, 16, 64)


def test_shapes_by_model_name():
  dsv3 = args.parse_shapes("deepseek_v3")
  assert ("deepseek_v3.q_proj_no_lora", 24576, 7168, None) in dsv3 and len(dsv3) == 11
  assert not [s for s in args.parse_shapes("all") if s.name.startswith("unaligned")]
  two = args.parse_shapes("deepseek_v3.q_proj_no_lora;qwen3_32b/down_proj;deepseek_v3.q_proj_no_lora")
  assert [(s.name, s.n, s.k) for s in two] == [("deepseek_v3.q_proj_no_lora", 24576, 7168),
                                               ("qwen3_32b.down_proj", 5120, 25600)]
  mixed = args.parse_shapes("qwen3_4b.o_proj;8,256,512")
  assert mixed == [("qwen3_4b.o_proj", 2560, 4096, None), ("256x512", 256, 512, (8,))]
  # --shapes_json: another table of models.
  table = {"toy": {"up": (512, 256)}}
  assert args.parse_shapes("toy", table=table) == [("toy.up", 512, 256, None)]


@pytest.mark.parametrize("text, flag, message", [
    ("1,2,3,4", "--shapes", "'1,2,3,4' is not N,K, M,N,K"),
    ("0,128", "--shapes", "'0,128': M, N and K must be positive"),
    ("a,b", "--shapes", "'a,b' is not N,K, M,N,K"),
    ("256,512;no_such_model", "--shapes",
     "'no_such_model' is not N,K, M,N,K (positive integers) or a shapes.json model"),
    ("deepseek_v3.nope", "--shapes", "deepseek_v3 has no layer 'nope'"),
    ("256,512;1,256,512", "--shapes", "256,512 is given both with and without M"),
    ("", "--shapes", "no shapes given"),
    ("256,512", "--models", "'256,512' is not a shapes.json model"),
])
def test_shapes_errors_name_the_flag_and_the_token(text, flag, message):
  with pytest.raises(args.UsageError) as error:
    args.parse_shapes(text, flag=flag, numbers=flag == "--shapes")
  assert str(error.value).startswith(f"{flag}: ") and message in str(error.value)
  assert isinstance(error.value, ValueError) and error.value.status == 2


def test_ms_errors_and_shapes_with_their_own_ms():
  for text, message in (("1,a", "--m: 'a' is not a positive integer (in '1,a')"), ("0", "--m: '0' is not a positive"),
                        ("", "--m: no values given")):
    with pytest.raises(args.UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
      args.parse_ms(text)
  shapes = args.parse_shapes("1,256,512;4,256,512;128,256")
  assert args.shapes_and_ms(shapes, (2,)) == ([("256x512", 256, 512), ("128x256", 128, 256)], {"256x512": [1, 4]})
  with pytest.raises(args.UsageError, match="every --shapes item gives its own M"):
    args.shapes_and_ms(shapes[:1], (2,))
