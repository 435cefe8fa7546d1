#include <criterion/criterion.h>
Test(todo, faults) { cr_assert(0, "not written"); }
