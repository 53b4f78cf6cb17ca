/* The type templates' naming (native_t.h, align_t.h): a source defines SUF (f32, f64) and includes
 * a template header once per type; DM_T(name) is then name_f32 or name_f64, each instance's own. */
#ifndef DM_TEMPLATE_H
#define DM_TEMPLATE_H
#define DM_T(name) DM_T_JOIN(name, SUF)
#define DM_T_JOIN(name, suffix) DM_T_PASTE(name, suffix)
#define DM_T_PASTE(name, suffix) name##_##suffix
#endif
