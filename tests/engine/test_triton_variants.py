"""hybrid_engine/triton_variants.py, the bookkeeping behind the GPU check that serving never
recompiles a kernel for an argument's value (tests/gpu/test_kernel_variants_cuda.py): Triton cache
keys as Triton 3.6 writes them, grouped by constexprs and argument types."""
from hybrid_engine.triton_variants import count_variants, specialization, value_class_free, value_recompiles

KEY = ("[('*bf16', 'D'), ('*i64', ''), ('i32', 'D'), ('constexpr', 1), ('constexpr', None), "
       "('constexpr', 32)]{'num_warps': 4, 'num_stages': 3}")
CONSTEXPR = [False, False, False, False, False, True]


def test_a_key_reads_back_as_its_specialization():
    assert specialization(KEY) == [("*bf16", "D"), ("*i64", ""), ("i32", "D"), ("constexpr", 1),
                                   ("constexpr", None), ("constexpr", 32)]
    assert specialization("[('i32', 'D'), oops]") is None


def test_value_classes_are_dropped_but_constexprs_and_none_arguments_kept():
    spec = specialization(KEY)
    other = [("*bf16", ""), ("*i64", "D"), ("i32", ""), ("i32", ""), ("constexpr", None), ("constexpr", 32)]
    assert value_class_free(spec, CONSTEXPR) == value_class_free(other, CONSTEXPR)
    # another constexpr value, or a pointer passed where None was, is another kernel
    assert value_class_free(spec, CONSTEXPR) != value_class_free(spec[:5] + [("constexpr", 64)], CONSTEXPR)
    assert value_class_free(spec, CONSTEXPR) != value_class_free(spec[:4] + [("*bf16", "D"), spec[5]], CONSTEXPR)


def test_only_new_value_classes_of_known_kernels_count_as_recompiles():
    before = {"k": {"A": {"a1", "a2"}}, "j": {"B": {"b1"}}}
    after = {"k": {"A": {"a1", "a2", "a3"}, "C": {"c1", "c2"}}, "j": {"B": {"b1"}}, "new": {"D": {"d1", "d2"}}}
    assert value_recompiles(before, after) == {"k": ["a3"]}
    assert value_recompiles(before, before) == {}
    assert count_variants(after) == 8
