/*
 * test_kv_plan: how a node sizes its KV pool (td_engine_kv_plan, td_engine.h "KV pool
 * sizing") and the memory budget behind it (td_engine_kv_budget). No model file: the
 * "tiny" preset's shape is all sizing reads. Budgets that depend on the machine are checked
 * against MemAvailable read here.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>

#include "td_engine.h"
#include "td_util.h"

static td_model_t model;
static td_engine_config_t ec;
static size_t block_bytes;

static void setup(void)
{
    memset(&model, 0, sizeof model);
    cr_assert_eq(td_model_preset("tiny", &model.config), TD_OK);
    ec = td_engine_config_default();
    block_bytes = td_engine_kv_block_bytes(&model, &ec);
    /* 2 (K, V) x layers x kv heads x head_dim x f32 x block_size */
    cr_assert_eq(block_bytes, 2u * 4 * 4 * 8 * sizeof(float) * (size_t)ec.block_size);
}

TestSuite(kv_plan, .init = setup);

Test(kv_plan, kv_blocks_is_exactly_that_many)
{
    td_kv_plan_params_t p = {.n_blocks = 300, .percent = 50, .cap = (size_t)1 << 40};
    td_kv_plan_t plan;
    cr_assert_eq(td_engine_kv_plan(&model, &ec, &p, &plan), TD_OK);
    cr_assert_eq(plan.n_blocks, 300);
    cr_assert_eq(plan.pool_bytes, 300 * block_bytes);
    cr_assert(strstr(plan.line, "300 blocks x 16 tokens = 4800 tokens") && strstr(plan.line, "(--kv-blocks)"),
              "%s", plan.line);
}

Test(kv_plan, kv_mem_holds_whole_blocks_up_to_what_the_node_can_use)
{
    td_kv_plan_params_t p = {.kv_mem = 10 * block_bytes + block_bytes / 2, .percent = 50, .cap = (size_t)1 << 40};
    td_kv_plan_t plan;
    cr_assert_eq(td_engine_kv_plan(&model, &ec, &p, &plan), TD_OK);
    cr_assert_eq(plan.n_blocks, 10);
    cr_assert(strstr(plan.line, ": --kv-mem)"), "%s", plan.line);

    p.useful_tokens = 4 * 16 + 1; /* 5 blocks */
    p.useful_what = "1 sequence of 65 tokens";
    cr_assert_eq(td_engine_kv_plan(&model, &ec, &p, &plan), TD_OK);
    cr_assert_eq(plan.n_blocks, 5);
    cr_assert(strstr(plan.line, "what 1 sequence of 65 tokens can use; kv-mem"), "%s", plan.line);
}

Test(kv_plan, default_budget_is_a_share_of_available_memory_capped)
{
    size_t avail;
    cr_assert_eq(td_mem_available(&avail), TD_OK);
    cr_assert_gt(avail, 0);
    td_kv_budget_t b = td_engine_kv_budget(50, (size_t)1 << 50, 0);
    cr_assert(b.measured && !b.capped);
    /* measured twice: memory moves a little in between */
    cr_assert(b.bytes > avail / 4 && b.bytes < avail, "budget %zu of %zu available", b.bytes, avail);
    b = td_engine_kv_budget(50, (size_t)1 << 20, 0);
    cr_assert(b.capped && b.bytes == (size_t)1 << 20);
    char d[128];
    cr_assert(strstr(td_engine_kv_budget_describe(&b, d, sizeof d), "the 1.0 MiB cap (50% of "), "%s", d);

    td_kv_plan_params_t p = {.percent = 50, .cap = 7 * block_bytes};
    td_kv_plan_t plan;
    cr_assert_eq(td_engine_kv_plan(&model, &ec, &p, &plan), TD_OK);
    cr_assert_eq(plan.n_blocks, 7);
    cr_assert(strstr(plan.line, "cap"), "%s", plan.line);
}

Test(kv_plan, device_pool_takes_the_fixed_default)
{
    td_kv_plan_params_t p = {.percent = 50, .cap = (size_t)1 << 40, .device = true, .device_default = 3 * block_bytes};
    td_kv_plan_t plan;
    cr_assert_eq(td_engine_kv_plan(&model, &ec, &p, &plan), TD_OK);
    cr_assert_eq(plan.n_blocks, 3);
    cr_assert(strstr(plan.line, "the fixed default for device memory"), "%s", plan.line);
}

Test(kv_plan, more_than_the_machine_is_refused_naming_size_and_flag)
{
    size_t avail;
    cr_assert_eq(td_mem_available(&avail), TD_OK);
    td_kv_plan_params_t p = {.kv_mem = avail * 10, .percent = 50, .cap = (size_t)1 << 50};
    td_kv_plan_t plan = {.n_blocks = -7};
    cr_assert_eq(td_engine_kv_plan(&model, &ec, &p, &plan), TD_ERR_NOMEM);
    cr_assert(strstr(td_last_error(), "more than") && strstr(td_last_error(), "lower --kv-mem"), "%s",
              td_last_error());
    cr_assert_eq(plan.n_blocks, -7, "the output is written only on success");

    p = (td_kv_plan_params_t){.n_blocks = 1 << 24, .percent = 50, .cap = (size_t)1 << 50};
    if ((size_t)(1 << 24) * block_bytes > avail) {
        cr_assert_eq(td_engine_kv_plan(&model, &ec, &p, &plan), TD_ERR_NOMEM);
        cr_assert(strstr(td_last_error(), "lower --kv-blocks"), "%s", td_last_error());
    }

    p = (td_kv_plan_params_t){.kv_mem = block_bytes - 1, .percent = 50, .cap = (size_t)1 << 50};
    cr_assert_eq(td_engine_kv_plan(&model, &ec, &p, &plan), TD_ERR_INVALID);
    cr_assert(strstr(td_last_error(), "holds no block"), "%s", td_last_error());
}

Test(kv_plan, bytes_read_as_people_write_them)
{
    char b[32];
    cr_assert_str_eq(td_format_bytes(100, b, sizeof b), "100 B");
    cr_assert_str_eq(td_format_bytes(1536, b, sizeof b), "1.5 KiB");
    cr_assert_str_eq(td_format_bytes((size_t)3 << 30, b, sizeof b), "3.0 GiB");
    cr_assert(td_cpu_count() >= 1);
}
