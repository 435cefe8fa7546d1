# The libFuzzer build of the fuzz targets (GNU make; run by the top Makefile's `make fuzz`,
# which passes the variables below). The project's sources a target needs are compiled
# again with clang and coverage, address and undefined-behaviour instrumentation, into
# tests/fuzz/obj/; each target links them with its harness and libFuzzer's main() into
# tests/fuzz/fuzz_<name>. Adding a target: a tests/fuzz/fuzz_<name>.c, a SRC_<name> line
# here and <name> in FUZZ_TARGETS in Makefile.am (beside its replay_<name> program).
#
# From the top Makefile: srcdir abs_srcdir FUZZ_CC FUZZ_TARGETS DEP_CFLAGS DEP_LIBS

QUEUE_SRC = queue/conn.c queue/queue.c queue/unit.c queue/progress.c gen/queue/scripts_lua.c
MODEL_SRC = kernels/model.c kernels/loader.c kernels/cpu/attention.c kernels/cpu/moe.c \
	kernels/safetensors.c kernels/pool.c kernels/sampler.c \
	kernels/make_model.c kernels/cpu/gemm.c kernels/ep/fabric.c kernels/ep/dispatch.c

SRC_safetensors = kernels/safetensors.c
SRC_st_index = $(MODEL_SRC)
SRC_model_config = $(MODEL_SRC)
SRC_unit = queue/unit.c
SRC_checkpoint = queue/progress.c
SRC_imds = imds/client.c imds/watch.c
SRC_config_file = agent/config.c $(QUEUE_SRC)
SRC_control = agent/control_proto.c
SRC_ep_card = $(MODEL_SRC)

O = tests/fuzz/obj
SAN = -fsanitize=address,undefined -fno-sanitize-recover=undefined
FUZZ_CFLAGS = -std=gnu11 -g -O1 -fno-omit-frame-pointer $(SAN) -fsanitize=fuzzer-no-link \
	-ffp-contract=off -Wall -Wno-unused-parameter -Wno-unknown-attributes \
	-I$(srcdir) -I. -D_GNU_SOURCE -DRO_SRCDIR='"$(abs_srcdir)"' -DRO_PKGDATADIR='"$(abs_srcdir)"' \
	$(DEP_CFLAGS)

BINS = $(FUZZ_TARGETS:%=tests/fuzz/fuzz_%)

all: $(BINS)

# fuzz_<name>: its harness and SRC_<name> (each source compiled once, shared by targets)
define fuzz_target
tests/fuzz/fuzz_$(1): $(O)/tests/fuzz/fuzz_$(1).o $(patsubst %.c,$(O)/%.o,$(SRC_$(1)))
	@echo "  FUZZLD   $$@"
	@$(FUZZ_CC) -fsanitize=fuzzer $(SAN) -o $$@ $$^ $(DEP_LIBS) -lpthread -lm
endef
$(foreach t,$(FUZZ_TARGETS),$(eval $(call fuzz_target,$(t))))

$(O)/gen/%.o: %.c
	@mkdir -p $(@D)
	@echo "  FUZZCC   $<"
	@$(FUZZ_CC) $(FUZZ_CFLAGS) -MMD -MP -c $< -o $@

$(O)/%.o: $(srcdir)/%.c
	@mkdir -p $(@D)
	@echo "  FUZZCC   $*.c"
	@$(FUZZ_CC) $(FUZZ_CFLAGS) -MMD -MP -c $< -o $@

-include $(shell find $(O) -name '*.d' 2>/dev/null)

.PHONY: all
